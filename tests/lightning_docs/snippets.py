"""The Trainer and Strategy constructions that Lightning's own documentation pages show, one record each, for
tests/test_lightning_docs.py: does ``distrain.lightning`` take what Lightning's docs tell its users to write?

Source: Lightning-AI/pytorch-lightning (https://github.com/Lightning-AI/pytorch-lightning), commit
7f0c3436cd3f6ad3753125672024fc415cbcb414, ``docs/source-pytorch/<page>``; licensed under the Apache License 2.0
(Copyright The Lightning AI team). The ``source`` strings are excerpts of those pages, verbatim: each code block
(``code-block:: python``, ``testcode::`` or a ``::`` literal block) that constructs a ``Trainer(...)`` or a
``*Strategy(...)`` is reduced to its construction lines and the imports they need, one record per construction (a
block showing alternatives, ``Trainer(precision="32")`` / ``Trainer(precision=32)``, gives one record each). What
the blocks do besides (models, data, ``fit``, Fabric) is left out. Where a record differs from the page, ``note``
says how: an import the block takes from an earlier block of its page (or from ``lightning.pytorch`` itself) is
written out, and Lightning's ``...`` ("your other arguments") placeholders are dropped, as are repeated keywords
that show alternatives (split into one record per alternative). Names a page defines elsewhere go in ``defs``
(the minimal stand-in, said in ``note``).

What the test runs is ``stand_in(migrate(defs + source))``:
(a) ``distrain.lightning.migrate``, the one mechanical edit of a migration: ``lightning.pytorch`` and
    ``pytorch_lightning`` → ``distrain.lightning``, ``lightning`` → ``distrain`` (``import lightning as L`` →
    ``import distrain as L``);
(b) ``stand_in``, the one documented stand-in for this machine's hardware (2 CPU cores, no GPU), in a
    ``Trainer(...)`` call only: ``accelerator="gpu"``/``"cuda"``/``"auto"`` → ``"cpu"``, and ``devices=<any value>``
    (a count, ``"auto"``, ``-1``, a list or string of GPU indices, ``find_usable_cuda_devices(2)``) → ``2``, or to
    the record's ``devices`` where the snippet's own sizes fix the world size (``ModelParallelStrategy(
    data_parallel_size=2, tensor_parallel_size=2)`` with ``devices=4`` keeps 4). ``num_nodes`` and everything
    else stay. An argument the snippet does not write stays unwritten. ``stand_in_applied`` records what (b)
    changed, and the test checks that it changes exactly that.

``expect`` is ``"constructs"`` or ``"refused: <regex of the one-line error>"``; a refusal has ``because``: what
Lightning itself needs that this machine lacks (fp16, Transformer Engine, a GPU-only feature, the NVMe drive a page
names), or ``lightning too: ...`` where Lightning refuses the line as written on any machine. ``xfail`` holds the
exact one-line error of a snippet that should construct and does not (a distrain gap, shown as a strict xfail)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

__all__ = ["FURTHER_PAGES", "PAGES", "SNIPPETS", "Snippet", "stand_in"]

#: the refusals that count as legitimate: what Lightning itself needs and this machine lacks, or Lightning's own
LEGITIMATE = ("fp16", "transformer engine", "gpu only", "machine lacks", "lightning too")


@dataclass(frozen=True)
class Snippet:
    page: str  #: docs/source-pytorch/<page> in Lightning's repository
    line: int  #: the line of the page where the code block starts (its directive)
    id: str
    source: str  #: Lightning's lines, verbatim but for what ``note`` says
    stand_in_applied: str = ""  #: what ``stand_in`` changes, "; "-separated ("" where nothing)
    expect: str = "constructs"
    because: str = ""  #: why a refusal is legitimate: one of LEGITIMATE, then a few words
    xfail: str = ""  #: the exact one-line error of a snippet that should construct and does not
    note: str = ""  #: how the record differs from the page, if at all
    defs: str = ""  #: stand-in definitions of names the page defines elsewhere
    devices: int = 2  #: the stand-in's device count

    @property
    def key(self) -> str:
        return f"{self.page.rsplit('/', 1)[-1].removesuffix('.rst')}:{self.id}"


_ACCELERATORS = ("gpu", "cuda", "auto")


def stand_in(source: str, devices: int = 2) -> tuple[str, list[str]]:
    """``source`` with the hardware stand-in applied to each ``Trainer(...)`` call (the module docstring's (b)), and
    what it changed (``accelerator='gpu'→'cpu'``). Edits the text in place: the rest stays as written."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name != "Trainer":
            continue
        for kw in node.keywords:
            value = kw.value
            if kw.arg == "accelerator" and isinstance(value, ast.Constant) and value.value in _ACCELERATORS:
                new = '"cpu"'
            elif kw.arg == "devices":
                new = str(devices)
            else:
                continue
            start = offsets[value.lineno - 1] + value.col_offset
            end = offsets[value.end_lineno - 1] + value.end_col_offset
            if source[start:end] != new:
                edits.append((start, end, new, f"{kw.arg}={source[start:end]}→{new}"))
    edits.sort()
    for start, end, new, _ in reversed(edits):
        source = source[:start] + new + source[end:]
    return source, [said for *_, said in edits]


_T = "from lightning.pytorch import Trainer\n"  # the pages' Trainer, where a block uses it without an import
_L = "import lightning as L\n"
_FSDP = "from lightning.pytorch.strategies import FSDPStrategy\n"
_ADDED_T = "`from lightning.pytorch import Trainer` added (the block uses Trainer without importing it)"
_ADDED_L = "`import lightning as L` added (the page imports it in an earlier block)"
_ADDED_FSDP = "`from lightning.pytorch.strategies import FSDPStrategy` added (the page imports it earlier)"
_ADDED_NN = "`import torch.nn as nn` added (the page imports it earlier)"
_DROPPED = "Lightning's `...` placeholder (your other arguments) dropped"
_FURTHER = "a further page's line (the page is not in the corpus whole: FURTHER_PAGES)"


def _gpu(devices: object, accelerator: str = "gpu") -> str:
    """What the stand-in changes in ``Trainer(accelerator=<accelerator>, devices=<devices>)``."""
    changed = f'accelerator="{accelerator}"→"cpu"'
    return changed if str(devices) == "2" else f"{changed}; devices={devices}→2"


def _cuda(devices: object) -> str:
    return _gpu(devices, "cuda")


#: distrain's one-line refusals, as regexes
_FP16_MIXED = r"^ValueError: precision='16-mixed' needs a CUDA GPU \(fp16 with a GradScaler\); on CPU use 'bf16-mixed'$"
_TE = r"^ValueError: precision='transformer-engine.*' is not run by distrain: NVIDIA Transformer Engine's layers"

SNIPPETS: list[Snippet] = [
    # ---- accelerators/gpu_basic.rst -----------------------------------------------------------------------------
    *(
        Snippet("accelerators/gpu_basic.rst", 25, id_, _T + line, applied, note=_ADDED_T)
        for id_, line, applied in [
            (
                "auto",
                'trainer = Trainer(accelerator="auto", devices="auto", strategy="auto")\n',
                'accelerator="auto"→"cpu"; devices="auto"→2',
            ),
            ("default", "trainer = Trainer()\n", ""),
            ("one-gpu", 'trainer = Trainer(accelerator="gpu", devices=1)\n', _gpu(1)),
            ("eight-gpus", 'trainer = Trainer(accelerator="gpu", devices=8)\n', _gpu(8)),
            ("devices-auto", 'trainer = Trainer(accelerator="gpu", devices="auto")\n', _gpu('"auto"')),
        ]
    ),
    *(
        Snippet(
            "accelerators/gpu_basic.rst",
            53,
            id_,
            _T + line,
            _gpu(devices),
            note=_ADDED_T + "; `k = 1` is the page's testsetup",
            defs="k = 1\n",
        )
        for id_, line, devices in [
            ("devices-k", 'Trainer(accelerator="gpu", devices=k)\n', "k"),
            ("devices-range", 'Trainer(accelerator="gpu", devices=list(range(k)))\n', "list(range(k))"),
            ("devices-list", 'Trainer(accelerator="gpu", devices=[0, 1])\n', "[0, 1]"),
            ("devices-string", 'Trainer(accelerator="gpu", devices="0, 1")\n', '"0, 1"'),
            ("devices-minus-one", 'Trainer(accelerator="gpu", devices=-1)\n', "-1"),
        ]
    ),
    Snippet(
        "accelerators/gpu_basic.rst",
        99,
        "find-usable-cuda-devices",
        _T + "from lightning.pytorch.accelerators import find_usable_cuda_devices\n\n"
        'trainer = Trainer(accelerator="cuda", devices=find_usable_cuda_devices(2))\n',
        _cuda("find_usable_cuda_devices(2)"),
        note=_ADDED_T + "; the block's Fabric lines left out",
    ),
    # ---- accelerators/gpu_faq.rst -------------------------------------------------------------------------------
    Snippet(
        "accelerators/gpu_faq.rst",
        22,
        "single-gpu",
        _T + 'Trainer(accelerator="gpu", devices=1)\n',
        _gpu(1),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_faq.rst",
        22,
        "multi-gpu",
        _T + 'Trainer(accelerator="gpu", devices=8)\n',
        _gpu(8),
        note=_ADDED_T + "; `strategy=...` (Lightning's placeholder for a strategy) dropped",
    ),
    Snippet(
        "accelerators/gpu_faq.rst",
        22,
        "multi-node",
        _T + 'Trainer(accelerator="gpu", devices=8, num_nodes=10)\n',
        _gpu(8),
        note=_ADDED_T + "; `strategy=...` (Lightning's placeholder for a strategy) dropped",
    ),
    *(
        Snippet(
            "accelerators/gpu_faq.rst",
            line,
            name,
            _T + f'Trainer(accelerator="gpu", devices=4, strategy="{name}")\n',
            _gpu(4),
            note=_ADDED_T,
        )
        for line, name in [(86, "ddp_notebook"), (110, "ddp_spawn"), (116, "ddp")]
    ),
    # ---- accelerators/gpu_intermediate.rst ----------------------------------------------------------------------
    Snippet(
        "accelerators/gpu_intermediate.rst",
        44,
        "ddp-8",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        44,
        "ddp-4-nodes",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp", num_nodes=4)\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        85,
        "ddp_spawn",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp_spawn")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        106,
        "notebook-default",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8)\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        106,
        "ddp_notebook",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp_notebook")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        106,
        "ddp_fork",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp_fork")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        168,
        "ddp",
        _T + 'Trainer(accelerator="gpu", devices=8, strategy="ddp")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "accelerators/gpu_intermediate.rst",
        186,
        "ddp-nccl",
        _T + "from lightning.pytorch.strategies import DDPStrategy\n\n"
        "# Explicitly specify the process group backend if you choose to\n"
        'ddp = DDPStrategy(process_group_backend="nccl")\n\n'
        "# Configure the strategy on the Trainer\n"
        'trainer = Trainer(strategy=ddp, accelerator="gpu", devices=8)\n',
        _gpu(8),
        expect=r"refused: ^ValueError: process group backend 'nccl' .*needs CUDA GPUs, and this run is on cpu",
        because="gpu only: NCCL runs on CUDA GPUs",
        note=_ADDED_T,
    ),
    # ---- advanced/model_parallel/deepspeed.rst ------------------------------------------------------------------
    *(
        Snippet(
            "advanced/model_parallel/deepspeed.rst",
            line,
            f"{name}-{line}",
            "from lightning.pytorch import Trainer\n\n"
            f'trainer = Trainer(accelerator="gpu", devices=4, strategy="{name}", precision=16)\n',
            _gpu(4),
        )
        for line, name in [
            (53, "deepspeed_stage_1"),
            (70, "deepspeed_stage_2"),
            (90, "deepspeed_stage_2_offload"),
            (133, "deepspeed_stage_2_offload"),
            (176, "deepspeed_stage_3"),
            (199, "deepspeed_stage_3"),
            (223, "deepspeed_stage_3"),
            (264, "deepspeed_stage_3_offload"),
            (294, "deepspeed_stage_3_offload"),
            (362, "deepspeed_stage_3_offload"),
        ]
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        108,
        "buckets",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

trainer = Trainer(
    accelerator="gpu",
    devices=4,
    strategy=DeepSpeedStrategy(offload_optimizer=True, allgather_bucket_size=5e8, reduce_bucket_size=5e8),
    precision=16,
)
""",
        _gpu(4),
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        264,
        "offload-parameters",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

trainer = Trainer(
    accelerator="gpu",
    devices=4,
    strategy=DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
    ),
    precision=16,
)
""",
        _gpu(4),
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        294,
        "nvme",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

trainer = Trainer(
    accelerator="gpu",
    devices=4,
    strategy=DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        remote_device="nvme",
        offload_params_device="nvme",
        offload_optimizer_device="nvme",
        nvme_path="/local_nvme",
    ),
    precision=16,
)
""",
        _gpu(4),
        expect=r"refused: ^ValueError: NVMe offload: nvme_path '/local_nvme' .*is not a writable directory",
        because="machine lacks: an NVMe drive at the page's /local_nvme (DeepSpeed's ZeRO-Infinity offload, a GPU "
        "feature); Lightning passes the path on and DeepSpeed needs it once fit starts, distrain checks it up front",
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        362,
        "cpu-checkpointing",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

# Enable CPU Activation Checkpointing
trainer = Trainer(
    accelerator="gpu",
    devices=4,
    strategy=DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,  # Enable CPU Offloading
        cpu_checkpointing=True,  # (Optional) offload activations to CPU
    ),
    precision=16,
)
""",
        _gpu(4),
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        442,
        "config-dict",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

deepspeed_config = {
    "zero_allow_untested_optimizer": True,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 3e-5,
            "betas": [0.998, 0.999],
            "eps": 1e-5,
            "weight_decay": 1e-9,
            "cuda_aware": True,
        },
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "last_batch_iteration": -1,
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-5,
            "warmup_num_steps": 100,
        },
    },
    "zero_optimization": {
        "stage": 2,  # Enable Stage 2 ZeRO (Optimizer/Gradient state partitioning)
        "offload_optimizer": {"device": "cpu"},  # Enable Offloading optimizer state/calculation to the host CPU
        "contiguous_gradients": True,  # Reduce gradient fragmentation.
        "overlap_comm": True,  # Overlap reduce/backward operation of gradients for speed.
        "allgather_bucket_size": 2e8,  # Number of elements to all gather at once.
        "reduce_bucket_size": 2e8,  # Number of elements we reduce/allreduce at once.
    },
}

trainer = Trainer(accelerator="gpu", devices=4, strategy=DeepSpeedStrategy(config=deepspeed_config), precision=16)
""",
        _gpu(4),
    ),
    Snippet(
        "advanced/model_parallel/deepspeed.rst",
        485,
        "config-file",
        """\
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

trainer = Trainer(
    accelerator="gpu", devices=4, strategy=DeepSpeedStrategy(config="/path/to/deepspeed_config.json"), precision=16
)
""",
        _gpu(4),
        expect="refused: /path/to/deepspeed_config.json",
        because="lightning too: the page's config path is a placeholder, and Lightning refuses a path that does not "
        "exist (`You passed in a path to a DeepSpeed config but the path does not exist`)",
    ),
    # ---- advanced/model_parallel/fsdp.rst -----------------------------------------------------------------------
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        52,
        "fsdp-name",
        _L + 'trainer = L.Trainer(accelerator="cuda", devices=2, strategy="fsdp")\n',
        _cuda(2),
        note=_ADDED_L,
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        59,
        "fsdp-instance",
        _L + "from lightning.pytorch.strategies import FSDPStrategy\n\n"
        'trainer = L.Trainer(accelerator="cuda", devices=2, strategy=FSDPStrategy())\n',
        _cuda(2),
        note=_ADDED_L,
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        68,
        "language-model",
        "import lightning as L\nfrom lightning.pytorch.strategies import FSDPStrategy\n\n"
        "# Trainer\n"
        'trainer = L.Trainer(accelerator="cuda", devices=2, strategy=FSDPStrategy())\n',
        _cuda(2),
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        132,
        "auto-wrap-layers",
        _L
        + "import torch.nn as nn\n"
        + _FSDP
        + """
# 1. Define a set of layers that FSDP should manage
#    Here we are choosing the large encoder and decoder layers
policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}

# 2. Pass the policy to the FSDPStrategy object
strategy = FSDPStrategy(auto_wrap_policy=policy)

trainer = L.Trainer(strategy=strategy)
""",
        note=f"{_ADDED_L}; {_ADDED_NN}; {_ADDED_FSDP}; {_DROPPED}",
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        147,
        "auto-wrap-size",
        _FSDP
        + """from functools import partial

# 1. Import a suiting wrapping policy from PyTorch
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

# 2. Configure the policy
policy = partial(size_based_auto_wrap_policy, min_num_params=10000)

# 3. Pass it to the FSDPStrategy object
strategy = FSDPStrategy(auto_wrap_policy=policy)
""",
        note=_ADDED_FSDP,
    ),
    *(
        Snippet(
            "advanced/model_parallel/fsdp.rst",
            240,
            name,
            _L + _FSDP + f'strategy = FSDPStrategy(\n    sharding_strategy="{name}",\n)\n'
            "trainer = L.Trainer(strategy=strategy)\n",
            **{
                "note": f"{_ADDED_L}; {_ADDED_FSDP}; {_DROPPED}; the block repeats `sharding_strategy=` to show its 4 "
                "values: one record each",
                **extra,
            },
        )
        for name, extra in [
            ("FULL_SHARD", {}),
            ("SHARD_GRAD_OP", {}),
            (
                "HYBRID_SHARD",
                dict(
                    note=f"{_ADDED_L}; {_ADDED_FSDP}; {_DROPPED}; the block repeats `sharding_strategy=` to show its "
                    "4 values: one record each. Lightning's own FSDPStrategy refuses this one as written (`The "
                    "hybrid sharding strategy requires you to pass at least one of the parameters: auto_wrap_policy, "
                    "process_group tuple, or device_mesh`); distrain takes it (shard within a node, replicate "
                    "across nodes)",
                ),
            ),
            ("NO_SHARD", {}),
        ]
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        307,
        "activation-checkpointing",
        _L
        + "import torch.nn as nn\n"
        + _FSDP
        + """
strategy = FSDPStrategy(
    # Enable activation checkpointing on these layers
    activation_checkpointing_policy={
        nn.TransformerEncoderLayer,
        nn.TransformerDecoderLayer,
    },
)
trainer = L.Trainer(strategy=strategy)
""",
        note=f"{_ADDED_L}; {_ADDED_NN}; {_ADDED_FSDP}; {_DROPPED}",
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        327,
        "cpu-offload",
        _L + _FSDP + "# Set `cpu_offload=True`\nstrategy = FSDPStrategy(cpu_offload=True)\n"
        "trainer = L.Trainer(strategy=strategy)\n",
        note=f"{_ADDED_L}; {_ADDED_FSDP}; {_DROPPED} (in both calls)",
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        365,
        "checkpoint-default",
        _L + "# Default: Saves a checkpoint every epoch\ntrainer = L.Trainer()\n",
        note=_ADDED_L,
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        380,
        "state-dict-full",
        _FSDP
        + '# Default: Save a single, consolidated checkpoint file\nstrategy = FSDPStrategy(state_dict_type="full")\n',
        note=_ADDED_FSDP,
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        380,
        "state-dict-sharded",
        _FSDP + "# Save individual files with state from each process\n"
        'strategy = FSDPStrategy(state_dict_type="sharded")\n',
        note=_ADDED_FSDP,
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        423,
        "resume",
        _L + "trainer = L.Trainer()\n",
        note=f"{_ADDED_L}; {_DROPPED}",
    ),
    *(
        Snippet(
            "advanced/model_parallel/fsdp.rst",
            473,
            f"limit-all-gathers-{str(value).lower()}",
            _L + _FSDP + f"strategy = FSDPStrategy(\n    limit_all_gathers={value},\n)\n"
            "trainer = L.Trainer(strategy=strategy)\n",
            note=f"{_ADDED_L}; {_ADDED_FSDP}; {_DROPPED}; the block repeats `limit_all_gathers=` to show both "
            "values: one record each",
        )
        for value in (False, True)
    ),
    Snippet(
        "advanced/model_parallel/fsdp.rst",
        496,
        "manual-wrap",
        'import lightning as L\n\ntrainer = L.Trainer(accelerator="cuda", devices=4, strategy="fsdp", precision=16)\n',
        _cuda(4),
    ),
    # ---- advanced/model_parallel/tp.rst -------------------------------------------------------------------------
    Snippet(
        "advanced/model_parallel/tp.rst",
        133,
        "strategy",
        """\
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

# 1. Create the strategy
strategy = ModelParallelStrategy()

# 2. Configure devices and set the strategy in Trainer
trainer = L.Trainer(accelerator="cuda", devices=2, strategy=strategy)
""",
        _cuda(2),
    ),
    Snippet(
        "advanced/model_parallel/tp.rst",
        150,
        "full-example",
        """\
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

strategy = ModelParallelStrategy()
trainer = L.Trainer(
    accelerator="cuda",
    devices=2,
    strategy=strategy,
    max_epochs=1,
)
""",
        _cuda(2),
    ),
    # ---- advanced/model_parallel/tp_fsdp.rst --------------------------------------------------------------------
    Snippet(
        "advanced/model_parallel/tp_fsdp.rst",
        84,
        "strategy-2x2",
        """\
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

# 1. Create the strategy
strategy = ModelParallelStrategy(
    # Define the size of the 2D parallelism
    # Set these to "auto" (default) to apply TP intra-node and FSDP inter-node
    data_parallel_size=2,
    tensor_parallel_size=2,
)

# 2. Configure devices and set the strategy in Trainer
trainer = L.Trainer(accelerator="cuda", devices=4, strategy=strategy)
""",
        'accelerator="cuda"→"cpu"',
        devices=4,
    ),
    Snippet(
        "advanced/model_parallel/tp_fsdp.rst",
        108,
        "full-example",
        """\
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

strategy = ModelParallelStrategy(
    data_parallel_size=2,
    tensor_parallel_size=2,
)
trainer = L.Trainer(
    accelerator="cuda",
    devices=4,
    strategy=strategy,
    max_epochs=1,
)
""",
        'accelerator="cuda"→"cpu"',
        devices=4,
    ),
    Snippet(
        "advanced/model_parallel/tp_fsdp.rst",
        216,
        "auto-sizes",
        """\
from lightning.pytorch.strategies import ModelParallelStrategy

strategy = ModelParallelStrategy(
    # Default is "auto"
    # Applies TP intra-node and DP inter-node
    data_parallel_size="auto",
    tensor_parallel_size="auto",
)
""",
    ),
    Snippet(
        "advanced/model_parallel/tp_fsdp.rst",
        243,
        "data",
        "import lightning as L\n\ntrainer = L.Trainer()\n",
        note=_DROPPED,
    ),
    # ---- clouds/cluster_advanced.rst ----------------------------------------------------------------------------
    Snippet(
        "clouds/cluster_advanced.rst",
        29,
        "ddp-4-nodes",
        _T + "# train on 32 GPUs across 4 nodes\n"
        'trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy="ddp")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    Snippet(
        "clouds/cluster_advanced.rst",
        36,
        "train-py",
        _T + 'trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy="ddp")\n',
        _gpu(8),
        note=_ADDED_T + "; the line out of the block's main()",
    ),
    Snippet(
        "clouds/cluster_advanced.rst",
        122,
        "slurm-requeue-signal",
        _T + "import signal\n\nfrom lightning.pytorch.plugins.environments import SLURMEnvironment\n\n"
        "trainer = Trainer(plugins=[SLURMEnvironment(requeue_signal=signal.SIGHUP)])\n",
        note=_ADDED_T + "; `import signal` and the page's next block's SLURMEnvironment import added",
    ),
    Snippet(
        "clouds/cluster_advanced.rst",
        128,
        "slurm-no-requeue",
        _T + "from lightning.pytorch.plugins.environments import SLURMEnvironment\n\n"
        "trainer = Trainer(plugins=[SLURMEnvironment(auto_requeue=False)])\n",
        note=_ADDED_T,
    ),
    # ---- clouds/cluster_expert.rst ------------------------------------------------------------------------------
    Snippet(
        "clouds/cluster_expert.rst",
        20,
        "custom-environment",
        _T
        + '''\
import os
from lightning.pytorch.plugins.environments import ClusterEnvironment


class MyClusterEnvironment(ClusterEnvironment):
    @property
    def creates_processes_externally(self) -> bool:
        """Return True if the cluster is managed (you don't launch processes yourself)"""
        return True

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        return int(os.environ["NODE_RANK"])

    def main_address(self) -> str:
        return os.environ["MASTER_ADDRESS"]

    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])


trainer = Trainer(plugins=[MyClusterEnvironment()])
''',
        expect="refused: TypeError: Can't instantiate abstract class MyClusterEnvironment with abstract methods "
        "detect, set_global_rank, set_world_size",
        because="lightning too: the page's class leaves three of ClusterEnvironment's abstract methods out (detect, "
        "set_global_rank, set_world_size), and Python refuses to make one, under Lightning 2.6.6 the same",
        note=_ADDED_T,
    ),
    # ---- clouds/cluster_intermediate_1.rst ----------------------------------------------------------------------
    Snippet(
        "clouds/cluster_intermediate_1.rst",
        47,
        "ddp-4-nodes",
        _T + "# train on 32 GPUs across 4 nodes\n"
        'trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy="ddp")\n',
        _gpu(8),
        note=_ADDED_T,
    ),
    # ---- common/checkpointing_advanced.rst ----------------------------------------------------------------------
    Snippet(
        "common/checkpointing_advanced.rst",
        24,
        "s3-root",
        _T + "# `default_root_dir` is the default path used for "
        'logs and checkpoints\ntrainer = Trainer(default_root_dir="s3://my_bucket/data/")\n',
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_advanced.rst",
        36,
        "tmpdir",
        _T + "trainer = Trainer(default_root_dir=tmpdir, max_steps=3)\n",
        note=_ADDED_T + "; `tmpdir` (the docs' pytest fixture) is the test's folder",
        defs="import os\n\ntmpdir = os.getcwd()\n",
    ),
    # ---- common/checkpointing_basic.rst -------------------------------------------------------------------------
    Snippet(
        "common/checkpointing_basic.rst",
        56,
        "default",
        _T + "# simply by using the Trainer you get automatic checkpointing\ntrainer = Trainer()\n",
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_basic.rst",
        69,
        "root-dir",
        _T + "# saves checkpoints to 'some/path/checkpoints/'\n"
        'trainer = Trainer(default_root_dir="some/path/", logger=False)\n',
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_basic.rst",
        76,
        "csv-logger",
        _T
        + """\
from lightning.pytorch.loggers import CSVLogger

# checkpoints will be saved to 'logs/my_experiment/version_0/checkpoints/'
# NOT to 'some/path/checkpoints/'
trainer = Trainer(
    default_root_dir="some/path/",  # This will be ignored for checkpoints!
    logger=CSVLogger("logs", "my_experiment")
)
""",
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_basic.rst",
        90,
        "checkpoint-dirpath",
        _T
        + """\
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.callbacks import ModelCheckpoint

# explicitly set checkpoint directory
checkpoint_callback = ModelCheckpoint(dirpath="my/custom/checkpoint/path/")
trainer = Trainer(
    logger=CSVLogger("logs", "my_experiment"),
    callbacks=[checkpoint_callback]
)
""",
        note=_ADDED_T + "; the CSVLogger import of the page's previous block added",
    ),
    Snippet(
        "common/checkpointing_basic.rst",
        234,
        "disable",
        _T + "trainer = Trainer(enable_checkpointing=False)\n",
        note=_ADDED_T,
    ),
    Snippet("common/checkpointing_basic.rst", 249, "resume", _T + "trainer = Trainer()\n", note=_ADDED_T),
    Snippet(
        "common/checkpointing_basic.rst",
        264,
        "resume-from-checkpoint",
        _T + 'trainer = Trainer(resume_from_checkpoint="path/to/your/checkpoint.ckpt")\n',
        expect="refused: ^ValueError: resume_from_checkpoint is not an option of any strategy",
        because="lightning too: the page's `Incorrect (deprecated) usage`; Lightning 2 has no resume_from_checkpoint "
        "(TypeError: unexpected keyword argument)",
        note=_ADDED_T,
    ),
    # ---- common/checkpointing_expert.rst ------------------------------------------------------------------------
    *(
        Snippet(
            "common/checkpointing_expert.rst",
            line,
            "sharded-save" if line == 22 else "sharded-load",
            """\
import lightning as L
from lightning.pytorch.strategies import FSDPStrategy

# 1. Select the FSDP strategy and set the sharded/distributed checkpoint format
strategy = FSDPStrategy(state_dict_type="sharded")

# 2. Pass the strategy to the Trainer
trainer = L.Trainer(devices=2, strategy=strategy)
""",
            note=_DROPPED,
        )
        for line in (22, 89)
    ),
    *(
        Snippet(
            "common/checkpointing_expert.rst",
            line,
            f"sharded-example-{line}",
            f"""\
import lightning as L
from lightning.pytorch.strategies import FSDPStrategy

strategy = FSDPStrategy(state_dict_type="sharded")
trainer = L.Trainer(
    accelerator="cuda",
    devices={devices},
    strategy=strategy,
    max_steps={steps},
)
""",
            _cuda(devices),
        )
        for line, devices, steps in ((42, 4, 3), (107, 2, 5))
    ),
    # ---- common/checkpointing_intermediate.rst ------------------------------------------------------------------
    Snippet(
        "common/checkpointing_intermediate.rst",
        17,
        "top-k",
        _T + "from lightning.pytorch.callbacks import ModelCheckpoint\n\n"
        'checkpoint_callback = ModelCheckpoint(dirpath="my/path/", save_top_k=2, monitor="val_loss")\n'
        "trainer = Trainer(callbacks=[checkpoint_callback])\n",
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_intermediate.rst",
        105,
        "monitor",
        _T + "from lightning.pytorch.callbacks import ModelCheckpoint\n\n"
        '# 3. Init ModelCheckpoint callback, monitoring "val_loss"\n'
        'checkpoint_callback = ModelCheckpoint(monitor="val_loss")\n\n'
        "# 4. Add your callback to the callbacks list\n"
        "trainer = Trainer(callbacks=[checkpoint_callback])\n",
        note=_ADDED_T,
    ),
    Snippet(
        "common/checkpointing_intermediate.rst", 180, "ddp", _T + 'trainer = Trainer(strategy="ddp")\n', note=_ADDED_T
    ),
    Snippet("common/checkpointing_intermediate.rst", 269, "strict", _T + "trainer = Trainer()\n", note=_ADDED_T),
    # ---- common/precision_basic.rst -----------------------------------------------------------------------------
    Snippet("common/precision_basic.rst", 26, "16-mixed", _T + 'Trainer(precision="16-mixed")\n', note=_ADDED_T),
    Snippet(
        "common/precision_basic.rst",
        38,
        "16-true",
        _T + 'Trainer(precision="16-true")\n',
        note=_ADDED_T,
    ),
    *(
        Snippet("common/precision_basic.rst", 60, f"32-{kind}", _T + f"Trainer(precision={value})\n", note=_ADDED_T)
        for kind, value in (("true", '"32-true"'), ("str", '"32"'), ("int", "32"))
    ),
    *(
        Snippet(
            "common/precision_basic.rst",
            78,
            f"64-{kind}",
            _T + f"Trainer(precision={value})\n",
            note=_ADDED_T,
        )
        for kind, value in (("true", '"64-true"'), ("str", '"64"'), ("int", "64"))
    ),
    Snippet(
        "common/precision_basic.rst",
        96,
        "64-init-module",
        _T + 'trainer = Trainer(precision="64-true")\n',
        note=_ADDED_T,
    ),
    # ---- common/precision_expert.rst ----------------------------------------------------------------------------
    Snippet(
        "common/precision_expert.rst",
        20,
        "custom-plugin",
        _T
        + """\
from lightning.pytorch.plugins.precision import Precision


class CustomPrecision(Precision):
    precision = "16-mixed"

    ...


trainer = Trainer(plugins=[CustomPrecision()])
""",
        note=_ADDED_T + "; the Precision import the page names (lightning.pytorch.plugins.precision) added",
    ),
    # ---- common/precision_intermediate.rst ----------------------------------------------------------------------
    Snippet(
        "common/precision_intermediate.rst",
        33,
        "32",
        _T + 'trainer = Trainer(accelerator="gpu", devices=1, precision=32)\n',
        _gpu(1),
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        70,
        "bf16-mixed-gpu",
        _T + 'Trainer(accelerator="gpu", devices=1, precision="bf16-mixed")\n',
        _gpu(1),
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst", 77, "bf16-mixed", _T + 'Trainer(precision="bf16-mixed")\n', note=_ADDED_T
    ),
    Snippet(
        "common/precision_intermediate.rst",
        92,
        "16-true",
        _T + '# Select FP16 precision\ntrainer = Trainer(precision="16-true")\n',
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        92,
        "bf16-true",
        _T + '# Select BF16 precision\ntrainer = Trainer(precision="bf16-true")\n',
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        104,
        "bf16-true-init-module",
        _T + 'trainer = Trainer(precision="bf16-true")\n',
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        138,
        "transformer-engine",
        _T + "# Select 8bit mixed precision via "
        'TransformerEngine, with model weights in bfloat16\ntrainer = Trainer(precision="transformer-engine")\n',
        expect=f"refused: {_TE}",
        because="transformer engine: not installed here, and it needs a GPU",
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        138,
        "transformer-engine-float16",
        _T + "# Select 8bit mixed precision "
        "via TransformerEngine, with model weights in float16\n"
        'trainer = Trainer(precision="transformer-engine-float16")\n',
        expect=f"refused: {_TE}",
        because="transformer engine: not installed here, and it needs a GPU",
        note=_ADDED_T,
    ),
    Snippet(
        "common/precision_intermediate.rst",
        138,
        "transformer-engine-plugin",
        _T
        + """\
import torch

# Customize the fp8 recipe or set a different base precision:
from lightning.trainer.plugins import TransformerEnginePrecision

recipe = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
precision = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=recipe)
trainer = Trainer(plugins=precision)
""",
        expect="refused: ^ModuleNotFoundError: No module named 'distrain.lightning.trainer.plugins'",
        because="lightning too: the page imports from lightning.trainer.plugins, which Lightning does not have "
        "(TransformerEnginePrecision is in lightning.pytorch.plugins); and Transformer Engine needs a GPU",
        note=_ADDED_T + "; `import torch` added",
    ),
    *(
        Snippet(
            "common/precision_intermediate.rst",
            188,
            id_,
            _T + "import torch\n\nfrom lightning.pytorch.plugins import BitsandbytesPrecision\n\n" + body,
            expect=r"refused: ^ImportError: distrain\.lightning\.plugins\.BitsandbytesPrecision: distrain has no "
            r"counterpart of Lightning's BitsandbytesPrecision: a precision is Trainer\(precision=\.\.\.\)",
            because="gpu only: Lightning's BitsandbytesPrecision runs on CUDA GPUs only (`Bitsandbytes is only "
            "supported on CUDA GPUs.`), and bitsandbytes is not installed here",
            note=_ADDED_T + "; `import torch` added",
        )
        for id_, body in [
            (
                "bitsandbytes-nf4",
                "# this will pick out the compute dtype automatically, by default `bfloat16`\n"
                'precision = BitsandbytesPrecision(mode="nf4-dq")\ntrainer = Trainer(plugins=precision)\n',
            ),
            (
                "bitsandbytes-int8",
                "# Customize the dtype, or skip some modules\n"
                'precision = BitsandbytesPrecision(mode="int8-training", dtype=torch.float16, '
                'ignore_modules={"lm_head"})\ntrainer = Trainer(plugins=precision)\n',
            ),
        ]
    ),
    # ---- further pages: the lines an outside run of every other page found failing, each fixed since ------------
    *(
        Snippet(
            "common/trainer.rst",
            464,
            f"autolog-hparams-{value}",
            _T + f"trainer = Trainer(enable_autolog_hparams={value})\n",
            note=f"{_ADDED_T}; {_FURTHER}",
        )
        for value in (True, False)
    ),
    Snippet(
        "common/trainer.rst",
        523,
        "model-summary-callback",
        _T + "from lightning.pytorch.callbacks import ModelSummary\n\n"
        "trainer = Trainer(enable_model_summary=True, callbacks=[ModelSummary(max_depth=-1)])\n",
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    *(
        Snippet(
            "common/trainer.rst",
            962,
            f"overfit-{kind}",
            _T + f"trainer = Trainer(overfit_batches={value})\n",
            note=f"{_ADDED_T}; {_FURTHER}",
        )
        for kind, value in (("fraction", "0.01"), ("count", "10"))
    ),
    Snippet(
        "common/trainer.rst",
        1152,
        "sync-batchnorm",
        _T + "trainer = Trainer(sync_batchnorm=True)\n",
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    Snippet(
        "advanced/training_tricks.rst",
        38,
        "clip-by-value",
        _T + "# clip gradients' maximum magnitude to <=0.5\n"
        'trainer = Trainer(gradient_clip_val=0.5, gradient_clip_algorithm="value")\n',
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    Snippet(
        "common/progress_bar.rst",
        33,
        "tqdm-refresh-rate",
        _T + "from lightning.pytorch.callbacks import TQDMProgressBar\n\n"
        "trainer = Trainer(callbacks=[TQDMProgressBar(refresh_rate=10)])\n",
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    Snippet(
        "common/progress_bar.rst",
        47,
        "tqdm-leave",
        _T + "from lightning.pytorch.callbacks import TQDMProgressBar\n"
        "trainer = Trainer(callbacks=[TQDMProgressBar(leave=True)])\n",
        note=f"{_ADDED_T}; the TQDMProgressBar import added (the page imports it in an earlier block); {_FURTHER}",
    ),
    Snippet(
        "common/gradient_accumulation.rst",
        23,
        "accumulation-schedule",
        _T + "from lightning.pytorch.callbacks import GradientAccumulationScheduler\n\n"
        "# till 5th epoch, it will accumulate every 8 batches. From 5th epoch\n"
        "# till 9th epoch it will accumulate every 4 batches and after that no accumulation\n"
        "# will happen. Note that you need to use zero-indexed epoch keys here\n"
        "accumulator = GradientAccumulationScheduler(scheduling={0: 8, 4: 4, 8: 1})\n"
        "trainer = Trainer(callbacks=accumulator)\n",
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    Snippet(
        "common/early_stopping.rst",
        42,
        "submodule-import",
        _T + "from lightning.pytorch.callbacks.early_stopping import EarlyStopping\n\n"
        'trainer = Trainer(callbacks=[EarlyStopping(monitor="val_loss", mode="min")])\n',
        note=f"{_ADDED_T}; the block's LitModel and fit left out; {_FURTHER}",
    ),
    Snippet(
        "debug/debugging_basic.rst",
        123,
        "model-summary-depth",
        _T + "from lightning.pytorch.callbacks import ModelSummary\n\n"
        "trainer = Trainer(callbacks=[ModelSummary(max_depth=-1)])\n",
        note=f"{_ADDED_T}; {_FURTHER}",
    ),
    Snippet(
        "starter/introduction.rst",
        231,
        "overfit-flags",
        _L + "# 20+ helpful flags for rapid idea iteration\n"
        "trainer = L.Trainer(\n    max_epochs=10,\n    min_epochs=5,\n    overfit_batches=1\n )\n",
        note=f"{_ADDED_L}; the block's other Trainers left out; {_FURTHER}",
    ),
]

#: every page of the corpus, with no snippet where it shows none (their Trainer lines are in prose or shell)
PAGES = [
    "accelerators/gpu_basic.rst",
    "accelerators/gpu_intermediate.rst",
    "accelerators/gpu_advanced.rst",
    "accelerators/gpu_expert.rst",
    "accelerators/gpu_faq.rst",
    "advanced/model_parallel/deepspeed.rst",
    "advanced/model_parallel/fsdp.rst",
    "advanced/model_parallel/tp.rst",
    "advanced/model_parallel/tp_fsdp.rst",
    "clouds/cluster_intermediate_1.rst",
    "clouds/cluster_intermediate_2.rst",
    "clouds/cluster_advanced.rst",
    "clouds/cluster_expert.rst",
    "common/checkpointing_basic.rst",
    "common/checkpointing_intermediate.rst",
    "common/checkpointing_advanced.rst",
    "common/checkpointing_expert.rst",
    "common/precision_basic.rst",
    "common/precision_intermediate.rst",
    "common/precision_expert.rst",
]
#: pages beyond those of the issue, not in the corpus whole: each line here is one that an outside run of every
#: other page's Trainer lines found failing under distrain, and that was fixed (2026-12-07)
FURTHER_PAGES = [
    "common/trainer.rst",
    "advanced/training_tricks.rst",
    "common/progress_bar.rst",
    "common/gradient_accumulation.rst",
    "common/early_stopping.rst",
    "debug/debugging_basic.rst",
    "starter/introduction.rst",
]
