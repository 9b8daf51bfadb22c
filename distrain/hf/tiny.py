"""Tiny Hugging Face models, tokenizers and datasets, built locally: examples and tests never download.

``make_tiny_bert(dir)`` / ``make_tiny_llama(dir)`` write a directory that ``from_pretrained`` (and
``distrain train --model_name dir``) load like any hub model: ``config.json``, weights and a
word-level tokenizer trained on the same synthetic text the datasets here hold.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path

import torch

POSITIVE = ["good", "great", "excellent", "wonderful", "loved", "fun", "brilliant", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "hated", "dull", "poor", "worst"]
NEUTRAL = [
    "the",
    "a",
    "movie",
    "film",
    "plot",
    "actors",
    "was",
    "and",
    "story",
    "music",
    "really",
    "quite",
    "very",
    "ending",
    "scenes",
    "this",
    "it",
    "felt",
    "cast",
    "director",
]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def reviews(n: int, seed: int = 0) -> list[dict]:
    """Short "movie reviews": label 1 when the sentiment words are positive, 0 when negative."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 10))]
        for _ in range(rng.randint(1, 2)):
            words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
        rows.append({"text": " ".join(words), "label": label})
    return rows


def counting_texts(n: int, seed: int = 0) -> list[str]:
    """Counting runs of random length ("three four five six"): next-token predictable, uneven lengths."""
    rng = random.Random(seed)
    return [
        " ".join(NUMBERS[(start + i) % 10] for i in range(rng.randint(3, 14)))
        for start in (rng.randrange(10) for _ in range(n))
    ]


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_tokenizer(special: dict[str, str], bert_template: bool = False):
    """A word-level tokenizer over this module's words (lower-cased, split on whitespace/punctuation)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys(special.values()))
    words = sorted(set(POSITIVE + NEGATIVE + NEUTRAL + NUMBERS))
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special["unk_token"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert_template:  # [CLS] text [SEP], as BERT's own tokenizer does
        cls, sep = special["cls_token"], special["sep_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def _write_atomically(out_dir: str | os.PathLike, write) -> str:
    """Build in a temp dir and rename: ranks that all call this (torchrun) never see half a model."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def make_tiny_bert(out_dir: str | os.PathLike, num_labels: int = 2, seed: int = 0, dropout: float = 0.1) -> str:
    """A 2-layer, 32-wide BertForSequenceClassification with its tokenizer (``dropout=0``: the same
    losses on any number of ranks, for parity checks)."""
    from transformers import BertConfig, BertForSequenceClassification

    def write(tmp: Path) -> None:
        tokenizer = make_tokenizer(
            {
                "unk_token": "[UNK]",
                "pad_token": "[PAD]",
                "cls_token": "[CLS]",
                "sep_token": "[SEP]",
                "mask_token": "[MASK]",
            },
            bert_template=True,
        )
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=num_labels,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            classifier_dropout=dropout,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed)
        BertForSequenceClassification(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _write_atomically(out_dir, write)


def make_tiny_llama(
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_position_embeddings: int = 128,
    heads: int = 2,
    kv_heads: int = 2,
    sliding_window: int | None = None,
    experts: int = 0,
) -> str:
    """A 2-layer LlamaForCausalLM, 16 wide per head (32 wide as made by default), with its tokenizer (no pad token,
    as Llama's own). ``kv_heads`` fewer than ``heads``: grouped-query attention. A ``sliding_window``: a
    MistralForCausalLM (Llama's layers, each token attending to the last ``sliding_window`` tokens only).
    ``experts``: a MixtralForCausalLM (Llama's layers, each MLP a mixture of that many experts, top-2)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    def write(tmp: Path) -> None:
        tokenizer = make_tokenizer({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
        config = dict(
            vocab_size=len(tokenizer),
            hidden_size=16 * heads,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=64,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        if experts:
            mixture = dict(num_local_experts=experts, num_experts_per_tok=2, intermediate_size=32)
            MixtralForCausalLM(MixtralConfig(**{**config, **mixture})).save_pretrained(tmp)
        elif sliding_window is None:
            LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(tmp)
        else:
            MistralForCausalLM(MistralConfig(**config, sliding_window=sliding_window)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _write_atomically(out_dir, write)
