"""Measured against predicted: a training run's real per-rank peak of tensor memory (torch's
``MemTracker`` around ``Trainer.fit``, in real mode: every tensor the run allocates, from building
the model to the last optimizer step) beside the planner's prediction for the same run.

``measure`` runs inside a rank whose process group already exists, so one pair of processes can
measure many configurations in a row (the accuracy test, ``tests/test_planner.py``, and
``benchmarks/plan_accuracy.py``): a harness for checking the planner, not part of it."""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from distrain.planner import fake

#: the models measured: the built-in GPT sizes and the tiny Hugging Face models of distrain.hf.tiny
HF_TINY = ("tiny-llama", "tiny-llama-gqa", "tiny-bert")


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    model: str
    strategy: str
    """``ddp``, ``fsdp:FULL_SHARD``, ``fsdp:SHARD_GRAD_OP``, ``zero1``, ``zero2``, ``zero3``; tensor parallel
    over every rank, with sequence parallelism (``tp``) or without (``tp:nosp``); ``tp×fsdp``: tensor
    parallel in pairs of ranks, FSDP across the pairs; ``cp``: context parallel over every rank; ``cp×fsdp``:
    context parallel in pairs of ranks, FSDP across data × context; ``pp`` (1F1B), ``pp:GPipe``,
    ``pp:Interleaved1F1B``: a pipeline stage per rank; ``pp×fsdp``: two stages (1F1B), FSDP across the rest;
    ``pp×tp``: two stages (1F1B), each tensor parallel (with sequence parallelism) over the rest;
    ``ddp+ep``, ``fsdp+ep``: a mixture of experts' experts over every rank (``expert_parallel_size``); ``cp+ep``:
    context parallel over every rank, the experts over every rank too."""
    ac: bool | str
    """Activation checkpointing of every block: True (whole), ``"selective"`` (per operation), False (none)."""
    micro_batch: int
    seq_len: int = 128
    precision: str = "32-true"
    bucket: int | None = None
    """ZeRO: reduce/all-gather bucket elements (None: DeepSpeedStrategy's default, 2e8)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (a pipeline's micro-batches)."""
    routing: str = "even"
    """A mixture of experts' router as trained (``even``), or ``collapsed``: every token sent to the first ``top_k``
    experts, the first rank's, whose measured peak is set beside the plan's worst routing (``worst_routing_peak``)."""

    @property
    def label(self) -> str:
        parts = [self.model, self.strategy.replace("fsdp:", "fsdp ")]
        if self.ac:
            parts.append("SAC" if self.ac == "selective" else "AC")
        parts.append(f"b={self.micro_batch}")
        if self.precision != "32-true":
            parts.append(self.precision)
        if self.bucket is not None:
            parts.append(f"bucket {self.bucket:,}")
        if self.accumulate > 1:
            parts.append(f"×{self.accumulate}")
        if self.routing != "even":
            parts.append(f"routing {self.routing}")
        return " ".join(parts)

    def planned_peak(self, row) -> int:
        """The planner's peak for this case: under collapsed routing, the row's worst-routing peak."""
        return row.worst_routing_peak if self.routing == "collapsed" else row.peak


#: the cases tests/test_planner.py asserts (within 10%): every strategy × activation checkpointing ×
#: model kind (GPT, Llama, BERT) at least once, at two micro-batch sizes; tensor parallel (a model with a
#: built-in plan) with and without sequence parallelism
ACCURACY_CASES = [
    Case("gpt-tiny", "ddp", False, 8),
    Case("gpt-mini", "ddp", True, 4),
    Case("gpt-mini", "ddp", "selective", 4),
    Case("tiny-bert", "ddp", False, 16),
    Case("gpt-tiny", "fsdp:FULL_SHARD", True, 8),
    Case("tiny-llama", "fsdp:FULL_SHARD", False, 16),
    Case("tiny-llama", "fsdp:FULL_SHARD", "selective", 16),
    Case("gpt-mini", "fsdp:SHARD_GRAD_OP", False, 4),
    Case("tiny-bert", "fsdp:SHARD_GRAD_OP", True, 8),
    Case("gpt-mini", "tp", False, 8),
    Case("gpt-tiny", "tp:nosp", False, 16),
    Case("tiny-llama", "tp:nosp", True, 16),
    Case("gpt-tiny", "zero1", False, 16, bucket=128 * 128),
    Case("tiny-llama", "zero1", True, 8, bucket=32 * 32),
    Case("gpt-tiny", "zero2", True, 8, bucket=128 * 128),
    Case("tiny-bert", "zero2", False, 16, bucket=32 * 32),
    Case("gpt-mini", "zero3", False, 4, bucket=384 * 384),
    Case("tiny-llama", "zero3", True, 16, bucket=32 * 32),
    Case("gpt-tiny-moe", "ddp+ep", False, 8),
    Case("gpt-tiny-moe", "fsdp+ep", True, 8),
    Case("gpt-tiny-moe", "ddp+ep", False, 8, routing="collapsed"),
    Case("gpt-tiny-moe", "tp", False, 8),  # each expert's hidden units split over the tensor-parallel ranks
    Case("gpt-tiny-moe", "cp+ep", False, 8, routing="collapsed"),  # context parallel, its experts split too
]
#: the built-in GPT with each block a mixture of experts: (model, experts, top_k)
MIXTURES = {"gpt-tiny-moe": ("gpt-tiny", 4, 2)}


#: pipeline cases (tests/test_plan_pipeline.py, within 10%), by world size: each schedule, with and without
#: activation checkpointing, under autocast, FSDP over replicated stages; accumulation = the pipeline's micro-batches
PIPELINE_CASES = {
    2: [
        Case("gpt-mini", "pp", False, 8, accumulate=4),
        Case("gpt-mini", "pp:GPipe", True, 2, precision="bf16-mixed", accumulate=4),  # bf16 on a CPU: slow, b=2
        Case("gpt-tiny", "pp:Interleaved1F1B", False, 8, accumulate=4),
        Case("gpt-tiny", "pp", True, 8, accumulate=2),
        Case("tiny-llama", "pp:GPipe", True, 16, accumulate=2),
        Case("gpt-tiny-moe", "pp", False, 4, accumulate=4),  # its balance loss's sum sent on beside the activations
    ],
    4: [
        Case("gpt-tiny", "pp:GPipe", False, 8, accumulate=4),
        Case("gpt-tiny", "pp×fsdp", True, 8, accumulate=2),
        Case("tiny-llama", "pp×fsdp", False, 16, accumulate=4),
        Case("tiny-llama", "pp×tp", False, 16, accumulate=4),
    ],
}


def hf_dirs(root: str) -> dict[str, str]:
    """The tiny Hugging Face models, written once under ``root`` (call before starting the ranks)."""
    from distrain.hf.tiny import make_tiny_bert, make_tiny_llama

    return {
        "tiny-llama": make_tiny_llama(os.path.join(root, "tiny-llama")),
        # 3 query heads over 1 key/value head: context parallelism over 2 or 4 ranks runs the ring
        "tiny-llama-gqa": make_tiny_llama(os.path.join(root, "tiny-llama-gqa"), heads=3, kv_heads=1),
        "tiny-bert": make_tiny_bert(os.path.join(root, "tiny-bert")),
    }


def spec_of(case: Case, hf: dict[str, str]):
    spec = _model_spec(case, hf)
    return spec.with_selective_checkpointing() if case.ac == "selective" else spec


def _model_spec(case: Case, hf: dict[str, str]):
    from distrain.planner.model_stats import ModelSpec

    if case.model in HF_TINY:
        return ModelSpec.huggingface(hf[case.model], case.seq_len)
    if case.model in MIXTURES:
        name, experts, top_k = MIXTURES[case.model]
        return ModelSpec.builtin_gpt(name, case.seq_len, n_experts=experts, top_k=top_k)
    return ModelSpec.builtin_gpt(case.model, case.seq_len)


def zero_section(case: Case) -> dict:
    if case.bucket is None:
        return {}
    return {"zero_optimization": {"reduce_bucket_size": case.bucket, "allgather_bucket_size": case.bucket}}


def predict(case: Case, world_size: int, hf: dict[str, str]):
    """The planner's per-rank row for ``case`` (CPU, as measured)."""
    from distrain.planner.estimate import Estimator

    return Estimator(job_of(case, world_size, hf)).estimate(option_of(case, world_size))


def job_of(case: Case, world_size: int, hf: dict[str, str]):
    from distrain.planner.estimate import Job

    configured = {"zero": {"json": _zero_config(case)}}
    job = Job(spec_of(case, hf), case.micro_batch, case.precision, world_size, configured=configured)
    return replace(job, accumulate=case.accumulate)


def option_of(case: Case, world_size: int):
    from distrain.planner.estimate import Option

    checkpoint = None if case.ac else 0
    if case.strategy.startswith("pp"):
        stages, schedule = _pipeline_layout(case.strategy, world_size)
        tensor = world_size // stages if case.strategy == "pp×tp" else 1
        return Option(
            "pp",
            sharding="FULL_SHARD" if stages * tensor < world_size else None,
            checkpoint=checkpoint,
            pipeline=stages,
            tensor=tensor,
            sequence_parallel=True if tensor > 1 else None,
            schedule=schedule,
            stages_per_rank=2 if schedule == "Interleaved1F1B" else 1,
        )
    if case.strategy == "ddp":
        return Option("ddp", checkpoint=checkpoint)
    if case.strategy == "ddp+ep":
        return Option("ddp", checkpoint=checkpoint, experts=world_size)
    if case.strategy == "fsdp+ep":
        return Option("fsdp", sharding="FULL_SHARD", checkpoint=checkpoint, experts=world_size)
    if case.strategy.startswith("fsdp:"):
        return Option("fsdp", sharding=case.strategy[5:], checkpoint=checkpoint)
    if case.strategy.startswith("tp"):
        layout = _tensor_layout(case.strategy, world_size)
        sharding = "FULL_SHARD" if layout["tensor"] < world_size else None
        return Option("tp", sharding=sharding, checkpoint=checkpoint, **layout)
    if case.strategy.startswith("cp"):
        experts = world_size if case.strategy == "cp+ep" else None
        context = _context_size(case, world_size)
        return Option("cp", sharding="FULL_SHARD", checkpoint=checkpoint, context=context, experts=experts)
    return Option("zero", stage=int(case.strategy[-1]), checkpoint=checkpoint)


def _zero_config(case: Case) -> dict:
    from distrain.strategies.deepspeed import DeepSpeedStrategy  # noqa: F401  (defaults below are its own)
    from distrain.strategies.deepspeed_config import options_config

    if not case.strategy.startswith("zero"):
        return {}
    bucket = case.bucket if case.bucket is not None else _strategy_default("reduce_bucket_size")
    return options_config(
        int(case.strategy[-1]), False, False, "cpu", "cpu", "/local_nvme", bucket, bucket, True, True, False, False
    )


def _strategy_default(name: str):
    import inspect

    from distrain.strategies.deepspeed import DeepSpeedStrategy

    return inspect.signature(DeepSpeedStrategy).parameters[name].default


def _pipeline_layout(strategy: str, world_size: int) -> tuple[int, str]:
    """The stages and schedule of a ``pp`` case."""
    stages = 2 if strategy in ("pp×fsdp", "pp×tp") else world_size
    return stages, (strategy[3:] if strategy.startswith("pp:") else "1F1B")


def _tensor_layout(strategy: str, world_size: int) -> dict:
    """The tensor-parallel size and sequence parallelism of a ``tp`` case."""
    return dict(tensor=2 if strategy == "tp×fsdp" else world_size, sequence_parallel=strategy != "tp:nosp")


def _context_size(case: Case, world_size: int) -> int:
    return 2 if case.strategy == "cp×fsdp" else world_size


def _strategy(case: Case, blocks: set, world_size: int):
    import distrain

    policy = {"classes": blocks, "selective": True} if case.ac == "selective" else blocks if case.ac else None
    if case.strategy == "pp×tp":
        stages, schedule = _pipeline_layout(case.strategy, world_size)
        return distrain.ModelParallelStrategy(
            tensor_parallel_size=world_size // stages,
            data_parallel_size=1,
            pipeline_stages=stages,
            schedule=schedule,
            activation_checkpointing_policy=policy,
        )
    if case.strategy.startswith("pp"):
        stages, schedule = _pipeline_layout(case.strategy, world_size)
        return distrain.PipelineStrategy(stages=stages, schedule=schedule, activation_checkpointing_policy=policy)
    if case.strategy.startswith("tp"):
        layout = _tensor_layout(case.strategy, world_size)
        return distrain.ModelParallelStrategy(
            tensor_parallel_size=layout["tensor"],
            data_parallel_size=world_size // layout["tensor"],
            sequence_parallel=layout["sequence_parallel"],
            activation_checkpointing_policy=policy,
        )
    if case.strategy.startswith("cp"):
        return distrain.ModelParallelStrategy(
            tensor_parallel_size=1,
            context_parallel_size=_context_size(case, world_size),
            expert_parallel_size=world_size if case.strategy == "cp+ep" else 1,
            activation_checkpointing_policy=policy,
        )
    if case.strategy == "ddp":
        return distrain.DDPStrategy(activation_checkpointing_policy=policy)
    if case.strategy == "ddp+ep":
        return distrain.DDPStrategy(activation_checkpointing_policy=policy, expert_parallel_size=world_size)
    if case.strategy == "fsdp+ep":
        return distrain.FSDPStrategy(activation_checkpointing_policy=policy, expert_parallel_size=world_size)
    if case.strategy.startswith("fsdp:"):
        return distrain.FSDPStrategy(sharding_strategy=case.strategy[5:], activation_checkpointing_policy=policy)
    kwargs = {}
    if case.bucket is not None:
        kwargs = dict(reduce_bucket_size=case.bucket, allgather_bucket_size=case.bucket)
    return distrain.DeepSpeedStrategy(stage=int(case.strategy[-1]), activation_checkpointing_policy=policy, **kwargs)


def _module(case: Case, hf: dict[str, str]):
    if case.model in HF_TINY:
        from distrain.hf import models
        from distrain.hf.tasks import TASK_MODULES, config_dict

        config = models.load_config(hf[case.model])
        task = models.infer_task(config)
        return TASK_MODULES[task](model_name=hf[case.model], hf_config=config_dict(config), pretrained=False)
    from distrain.models.lm import GPTLanguageModel

    if case.model in MIXTURES:
        name, experts, top_k = MIXTURES[case.model]
        module = GPTLanguageModel(name, block_size=case.seq_len, lr_schedule="constant", n_experts=experts, top_k=top_k)
        if case.routing == "collapsed":
            _collapse_routing(module, top_k)
        return module
    return GPTLanguageModel(case.model, block_size=case.seq_len, lr_schedule="constant")


def _collapse_routing(module, top_k: int) -> None:
    """Every router of ``module`` (once its model is built) sends every token to experts 0 … ``top_k`` − 1: the
    first rank's under expert parallelism, which then receives every rank's tokens."""
    from distrain.parallel.expert_parallel import moe_layers

    def collapsed(router, args, out):
        preference = torch.zeros(out.shape[-1], dtype=out.dtype)
        preference[:top_k] = torch.arange(top_k, 0, -1, dtype=out.dtype) * 10
        return out * 0 + preference

    configure = module.configure_model

    def configure_collapsed() -> None:
        configure()
        for layer in moe_layers(module):
            layer.router.register_forward_hook(collapsed)

    module.configure_model = configure_collapsed


class _Samples(torch.utils.data.Dataset):
    """``n`` copies of the planner's own sample batch, one sample at a time."""

    def __init__(self, batch: Any, n: int):
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        b = self.batch
        if isinstance(b, dict):  # a Hugging Face batch: with the all-ones attention mask real data has
            return {**{k: v[0] for k, v in b.items()}, "attention_mask": torch.ones_like(b["input_ids"][0])}
        return tuple(t[0] for t in b)


def measure(case: Case, world_size: int, hf: dict[str, str], workdir: str, steps: int = 2) -> int:
    """This rank's peak tensor bytes over a ``Trainer.fit`` of ``steps`` optimizer steps (the
    second step is the first with optimizer state). Call in every rank, in the same order."""
    import distrain
    from distrain.planner.model_stats import ModelSpec  # noqa: F401

    spec = spec_of(case, hf)
    # MemTracker's backward hooks break torch.distributed.pipelining's autograd.grad: a pipeline's peak is
    # counted by storage instead
    tracker = StoragePeak() if case.strategy.startswith("pp") else fake.peak_memory_tracker()
    data = torch.utils.data.DataLoader(
        _Samples(spec.make_batch(1), case.micro_batch * world_size * steps * case.accumulate),
        batch_size=case.micro_batch,
    )

    with tracker:
        module = _module(case, hf)
        trainer = distrain.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=_strategy(case, set(spec.block_classes), world_size),
            precision=case.precision,
            max_steps=steps,
            accumulate_grad_batches=case.accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=workdir,
        )
        trainer.fit(module, data)
        peak = tracker.peak_bytes()
    del trainer, module, data
    gc.collect()
    return peak


class StoragePeak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once, over every operation run inside it: each new storage
    an operation returns is counted until it is freed. (No module hooks, unlike MemTracker.)"""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)  # a DTensor (tensor parallel, FSDP2): its shard's storage
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def peak_bytes(self) -> int:
        return self.peak


def measure_cases(rank: int, cases: list[Case], world_size: int, hf: dict[str, str], workdir: str) -> list[int]:
    """Every case in this rank, one after the other (for ``tests/helpers.run_ranks``)."""
    return [measure(c, world_size, hf, workdir) for c in cases]


def with_bucket(case: Case, bucket: int | None) -> Case:
    return replace(case, bucket=bucket)


def measure_in_processes(cases: list[Case], world_size: int, hf: dict[str, str], workdir: str) -> list[list[int]]:
    """Spawn ``world_size`` ranks (gloo, one process group for every case) and measure each case
    in all of them; returns, per case, every rank's peak."""
    import pickle
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from distrain.cluster import find_free_port

    with tempfile.TemporaryDirectory() as out:
        port = find_free_port()
        mp.start_processes(
            _rank, args=(cases, world_size, hf, workdir, port, out), nprocs=world_size, start_method="spawn"
        )
        per_rank = [pickle.loads((Path(out) / f"{r}.pkl").read_bytes()) for r in range(world_size)]
    return [list(values) for values in zip(*per_rank)]


def _rank(rank, cases, world_size, hf, workdir, port, out):
    import pickle
    from pathlib import Path

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    peaks = measure_cases(rank, cases, world_size, hf, workdir)
    # written by this rank for the parent that spawned it
    (Path(out) / f"{rank}.pkl").write_bytes(pickle.dumps(peaks))
    from distrain.distributed import shutdown

    shutdown()
