"""transformers' private and version-sensitive calls: its experts' kernels and gates, initialization switched off, the
causal mask of a pipeline stage. Each names what it relies on and the versions it was checked against;
``tests/test_compat.py`` exercises each for real (``distrain/compat/__init__.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("distrain")

# ---- transformers ---------------------------------------------------------------------------------------
# Checked against transformers 5.23.


def experts_grouped_forward(experts: Any) -> Callable[..., Any] | None:
    """transformers' own grouped-matmul forward of an experts module built with ``use_experts_implementation``
    (``integrations.moe.grouped_mm_experts_forward``, transformers 5.25: ``forward(self, hidden_states,
    top_k_index, top_k_weights)``), which computes every layout the decorator's flags declare (transposed, biased,
    interleaved, without a gate, normed after each expert); None for a module built without it."""
    if not hasattr(experts, "is_transposed") or not isinstance(getattr(experts, "num_experts", None), int):
        return None
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def experts_gate(experts: Any) -> Callable[[Any], Any] | None:
    """A Hugging Face experts module's own gating of its ``gate_up_proj`` output, where it has one: clamps (DeepSeek
    V4), softcaps and two-argument activations (Inkling 2). ``_apply_gate``, private in transformers 5.25, is what its
    grouped-matmul backends call too; None where the module has none (``act_fn(gate) * up``)."""
    gate = getattr(experts, "_apply_gate", None)
    return gate if callable(gate) else None


def transformers_no_init_weights():
    """Build a model without running its initializers (``transformers.initialization.no_init_weights``
    in 5.x)."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


# ---- transformers (pipeline stages of Llama-style models) -----------------------------------------------------------
def hf_causal_mask(config, inputs_embeds, attention_mask, position_ids):
    """The causal (and padding) mask a Llama-style model builds in its forward, for a pipeline stage that
    runs some of its layers: ``transformers.masking_utils.create_causal_mask(config, inputs_embeds,
    attention_mask, past_key_values, position_ids)`` (transformers 5.4+, pyproject's floor: 5.0–5.3 name the
    embeddings ``input_embeds`` and need ``cache_position``; may return None for SDPA's own causal path)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    # no cache: named ``cache`` since transformers 5.2x (``past_key_values`` is deprecated there, and warns)
    no_cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{no_cache: None},
    )
