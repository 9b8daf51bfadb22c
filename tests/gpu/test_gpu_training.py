"""The GPU suite: everything distrain does only on CUDA, run for real (``python -m pytest tests/gpu -m gpu -q``;
skipped, with the reason, where CUDA is missing). This file: training on CUDA — every strategy against one
process, the precisions (bf16 and fp16 autocast, the fp16 GradScaler, FSDP2's MixedPrecisionPolicy, fp8 through
torchao with FSDP's float8 all-gather), DeepSpeed's CUDA ops and pinned CPU-Adam offload, torch.compile, tensor
parallel and pipelines. ``test_gpu_observability.py``: NVML, CUDA memory statistics, MFU, ``distrain bench`` and
NCCL's flight recorder.

How ranks run. World size 1 under NCCL works on any GPU: every strategy runs there (``ddp``, ``fsdp``,
``fsdp_cpu_offload``, ``model_parallel``, ZeRO-1/2/3 with and without CPU offload). Two ranks need two GPUs under
NCCL (NCCL refuses two ranks on one device); on a one-GPU machine the two-rank tests share ``cuda:0`` and use gloo,
which moves CUDA tensors through host memory for DDP's all-reduce. FSDP2's and tensor parallelism's DTensor
collectives over gloo on CUDA tensors crashed with SIGSEGV (torch 2.11 on an H200), so distrain refuses those
strategies under gloo on CUDA, and on one GPU the test checks the refusal. Gloo has no CUDA send/recv, so the
pipeline needs two GPUs.

Tolerances (relative, on each step's loss and gradient norm; the one-process run is the reference, same weights
and same global batch): fp32 1e-5 on the first step and 1e-4 after it (GPU kernels may add in another order, and
Adam magnifies the difference; ZeRO's flat buckets 1e-3, as on CPU); bf16 and fp16 autocast 1e-2 on losses and
3e-2 on gradient norms (on CPU the same runs differ by 7e-5 and 2.5e-3: ten times that); fp8 5e-2 against bf16.

What stays unproven on one GPU (these tests skip there, saying so, and run on two or more GPUs):
- NCCL between ranks: every one-GPU multi-rank run uses gloo over host memory, so NCCL's own all-reduce,
  all-gather, reduce-scatter (and its AVG reduction) between two processes is not exercised;
- pipelines on CUDA (``test_pipeline_on_two_gpus_matches_one_process``): stage-to-stage send/recv;
- a stuck rank's flight-recorder dump naming it (``test_gpu_observability.py``); on one GPU only the recorder
  itself is checked (on, recording NCCL collectives with distrain's timeout, dumping into the run directory);
- DeepSpeed, FSDP and tensor parallelism on more than one rank on CUDA (each needs NCCL between ranks), FSDP's
  mixed-precision all-gather and reduce-scatter dtypes, and fp8's float8 all-gather (FSDP2 skips its
  collectives at world size 1);
- anything about speed at scale (overlap of communication, bandwidth, MFU on 8 GPUs): ``benchmarks/gpu_bench.py``.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import distrain
from distrain.models.gpt import GPT, Block, GPTConfig
from helpers import IndexedTokens, LossRecorder, run_ranks

NO_CUDA = "CUDA is missing (torch.cuda.is_available() is False): the GPU suite needs an NVIDIA GPU"
CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)]

#: two ranks: NCCL with a GPU each; on one GPU both share cuda:0 under gloo (NCCL refuses two ranks on a device)
TWO_RANK_BACKEND = "nccl" if GPUS >= 2 else "gloo"
TWO_RANKS = {"process_group_backend": "gloo"} if TWO_RANK_BACKEND == "gloo" else {}

STEPS, BATCH, SEQ = 4, 8, 32
TOLERANCE = {  # (first step, later steps), relative: see the module docstring
    "32-true": (1e-5, 1e-4),
    "bf16-mixed": (1e-2, 1e-2),
    "16-mixed": (1e-2, 1e-2),
}
NORM_TOLERANCE = {"32-true": None, "bf16-mixed": 3e-2, "16-mixed": 3e-2}  # None: as the losses
ZERO_LATER = 1e-3  # fp32 under ZeRO after the first step (bucketed sums in another order)

#: world size 1 under NCCL: every strategy, in three processes (DeepSpeed's offload engines hold pinned buffers)
WS1_SESSIONS = (
    ("ddp", "fsdp", "fsdp_cpu_offload", "model_parallel"),
    ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"),
    ("deepspeed_stage_2_offload", "deepspeed_stage_3_offload"),
)


# ---- the job ---------------------------------------------------------------------------------------------
class GpuGPT(distrain.Module):
    """distrain's GPT, 2 blocks 64 wide (every linear a multiple of 16, as float8 matmuls need), built in
    ``configure_model`` (meta device and sharded initialization under FSDP, ``zero.Init`` under ZeRO-3).
    ``overflow_step``: the loss of that optimizer step is multiplied by 1e34 on ``overflow_rank`` (finite,
    but infinite once fp16's GradScaler multiplies it by 65536). ``probe``: record the dtype of a linear's
    weight as its forward sees it."""

    block_class = Block

    def __init__(
        self,
        lr: float = 3e-3,
        overflow_step: int | None = None,
        overflow_rank: int = 1,
        probe: bool = False,
        n_experts: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.gpt = None
        self.forward_weight_dtypes: set[str] = set()

    def configure_model(self):
        if self.gpt is None:
            self.gpt = GPT(
                GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=SEQ, n_experts=self.hparams["n_experts"])
            )
            if self.hparams["probe"]:  # runs inside the block's FSDP unit: after its all-gather
                self.gpt.blocks[0].mlp.fc.register_forward_pre_hook(self._probe)

    def _probe(self, layer, args):
        self.forward_weight_dtypes.add(str(layer.weight.dtype))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = self.gpt(x, y)
        h, trainer = self.hparams, self.trainer
        if h["overflow_step"] == trainer.global_step + 1 and trainer.global_rank == h["overflow_rank"]:
            loss = loss * 1e34
        return loss

    def flops_per_token(self) -> float:
        return self.gpt.flops_per_token()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.1)


class Probe(distrain.Callback):
    """What a run did besides its losses, read inside the rank: ``steps`` (the flat parameters and the
    GradScaler's scale after every optimizer step), ``deepspeed`` (the engine's optimizers and where its state
    lives), ``compiled`` / ``float8`` (which modules were compiled or converted), ``dtypes`` (parameter, optimizer
    state and forward dtypes), ``trace`` (this rank's flight-recorder entries at step 2)."""

    def __init__(self, kinds=()):
        self.kinds = set(kinds)
        self.found: dict = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if "steps" in self.kinds:
            flat = torch.cat([p.detach().float().flatten() for p in module.parameters()]).cpu()
            scaler = trainer.runtime.precision.scaler
            self.found.setdefault("params", []).append(flat)
            self.found.setdefault("scales", []).append(scaler.get_scale() if scaler is not None else None)
        if "trace" in self.kinds and trainer.global_step == 2:
            self.found["trace"] = flight_recorder_entries()
            self.found["dump_prefix"] = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")

    def on_train_end(self, trainer, module):
        if "deepspeed" in self.kinds:
            self.found.update(_deepspeed_facts(trainer, module))
        if "compiled" in self.kinds:
            self.found["compiled"] = [n for n, m in module.named_modules() if hasattr(m.forward, "__wrapped__")]
        if "float8" in self.kinds:
            self.found["float8"] = [n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"]
        if "dtypes" in self.kinds:
            states = trainer.optimizers[0].state.values()
            self.found.update(
                forward_weight_dtypes=sorted(module.forward_weight_dtypes),
                param_dtypes=sorted({str(p.dtype) for p in module.parameters()}),
                param_kinds=sorted({type(p).__name__ for p in module.parameters()}),
                state_dtypes=sorted(
                    {str(v.dtype) for s in states for v in s.values() if torch.is_tensor(v) and v.dim()}
                ),
            )


def _deepspeed_facts(trainer, module) -> dict:
    engine = trainer.strategy.engine
    zero = trainer.strategy.filled_config["zero_optimization"]
    ds_tensors = [p.ds_tensor for p in module.parameters() if hasattr(p, "ds_tensor")]
    return {
        "optimizer": type(engine.basic_optimizer).__name__,
        "pin_in_config": {k: zero[k].get("pin_memory") for k in ("offload_optimizer", "offload_param") if k in zero},
        "optimizer_pinned": getattr(engine.optimizer, "offload_optimizer_pin_memory", None),
        "param_partitions": sorted({(t.device.type, t.is_pinned()) for t in ds_tensors}),
    }


def flight_recorder_entries() -> list[dict]:
    """This process's flight-recorder records (NCCL's recorder on a CUDA build of torch)."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    keys = ("profiling_name", "timeout_ms", "state", "collective_seq_id")
    return [{k: e.get(k) for k in keys} for e in pickle.loads(dump()).get("entries", [])]


class CollectiveLog:
    """Pass-through instrumentation of FSDP2's all-gather and reduce-scatter (the real collectives still run):
    the dtypes they moved and the bytes all-gathered."""

    def __init__(self):
        self.gathered: set[str] = set()
        self.reduced: set[str] = set()
        self.gathered_bytes = 0
        self.reduce_scatters = 0

    def __enter__(self):
        # FSDP2 calls all_gather_single / reduce_scatter_single from torch 2.13, the *_into_tensor / *_tensor
        # names before (torch 2.11's)
        self._names = [
            next(name for name in names if hasattr(dist, name))
            for names in (
                ("all_gather_single", "all_gather_into_tensor"),
                ("reduce_scatter_single", "reduce_scatter_tensor"),
            )
        ]
        self._real = tuple(getattr(dist, name) for name in self._names)
        real_gather, real_reduce = self._real

        def gather(output_tensor, input_tensor, *args, **kwargs):
            self.gathered.add(str(input_tensor.dtype))
            self.gathered_bytes += output_tensor.numel() * output_tensor.element_size()
            return real_gather(output_tensor, input_tensor, *args, **kwargs)

        def reduce(output, input, *args, **kwargs):
            self.reduced.add(str(input.dtype))
            self.reduce_scatters += 1
            return real_reduce(output, input, *args, **kwargs)

        for name, wrapper in zip(self._names, (gather, reduce)):
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, real in zip(self._names, self._real):
            setattr(dist, name, real)


def fit(
    root,
    strategy: str,
    devices: int = 1,
    precision: str = "32-true",
    accumulate: int = 1,
    batch: int = BATCH,
    clip: float | None = 1.0,
    module_kw: dict | None = None,
    inspect: tuple = (),
    log_collectives: bool = False,
    **options,
) -> dict:
    """Train GpuGPT on the GPU for STEPS steps; returns the losses and gradient norms rank 0's logger saw,
    and what ``inspect`` (Probe's kinds) and ``log_collectives`` asked for."""
    recorder, probe = LossRecorder(), Probe(inspect)
    options.setdefault("logger", False)
    options.setdefault("collective_timeout", 120)
    trainer = distrain.Trainer(
        accelerator="gpu",
        strategy=strategy,
        devices=devices,
        precision=precision,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        seed=7,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_plots=False,
        default_root_dir=str(root),
        callbacks=[recorder, probe],
        **options,
    )
    module = GpuGPT(**(module_kw or {}))
    data = DataLoader(IndexedTokens(96, seq_len=SEQ), batch_size=batch, shuffle=True)
    log = CollectiveLog()
    if log_collectives:
        with log:
            trainer.fit(module, data)
    else:
        trainer.fit(module, data)
    out = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, **probe.found}
    if log_collectives:
        out.update(gathered=sorted(log.gathered), reduced=sorted(log.reduced), gathered_bytes=log.gathered_bytes)
        out["reduce_scatters"] = log.reduce_scatters
    return out


def session(rank, root, runs):
    """``runs``: (name, keyword arguments of ``fit``) pairs, trained one after another in this rank."""
    out = {}
    for name, kwargs in runs:
        out[name] = fit(Path(root) / name, **kwargs)
        gc.collect()  # the trainer, its engine and the module refer to each other
    return out


def assert_matches(
    reference: dict,
    run: dict,
    what: str,
    precision: str = "32-true",
    first: float | None = None,
    later: float | None = None,
):
    """Each step's loss (and gradient norm, when both runs clipped) within the precision's tolerance."""
    first_default, later_default = TOLERANCE[precision]
    first = first if first is not None else first_default
    later = later if later is not None else later_default
    assert len(run["losses"]) == len(reference["losses"]) == STEPS, (what, run["losses"])
    pairs = [("loss", reference["losses"], run["losses"], None)]
    if reference["grad_norms"] or run["grad_norms"]:
        pairs.append(("grad norm", reference["grad_norms"], run["grad_norms"], NORM_TOLERANCE[precision]))
    for name, expected, got, tolerance in pairs:
        assert len(got) == len(expected) == STEPS, (what, name, got)
        for step, (a, b) in enumerate(zip(expected, got), start=1):
            tol = tolerance or (first if step == 1 else later)
            assert math.isfinite(b) and abs(a - b) <= tol * abs(a), (
                f"{what}: {name} at step {step} is {b}, the one-process run's {a} (relative tolerance {tol})"
            )


def _ws1(tmp_path, precision: str, sessions=WS1_SESSIONS, reference: bool = True, **kw) -> dict:
    """Every strategy in ``sessions`` at world size 1 (NCCL), each session one rank process; the one-process
    reference ("single") trains first in the first session."""
    out = {}
    for i, names in enumerate(sessions):
        runs = [("single", dict(strategy="single", precision=precision, **kw))] if i == 0 and reference else []
        runs += [(n, dict(strategy=n, precision=precision, inspect=_facts_of(n), **kw)) for n in names]
        out.update(run_ranks(session, 1, str(tmp_path / precision / str(i)), runs)[0])
    return out


def _facts_of(strategy: str) -> tuple:
    return ("deepspeed",) if strategy.startswith("deepspeed") else ()


@pytest.fixture(scope="module")
def fp32_world_size_1(tmp_path_factory):
    """fp32 at world size 1, every strategy; shared by the parity and the DeepSpeed tests (a cold
    ~/.cache/torch_extensions JIT-builds DeepSpeed's CPU Adam and FusedAdam inside it: about 2 minutes)."""
    pytest.importorskip("deepspeed")
    return _ws1(tmp_path_factory.mktemp("ws1"), "32-true")


# ---- every strategy at world size 1 under NCCL ------------------------------------------------------------
@pytest.mark.timeout(900)
def test_every_strategy_at_world_size_1_under_nccl_matches_one_process_fp32(fp32_world_size_1):
    runs = fp32_world_size_1
    assert set(runs) == {"single", *(n for s in WS1_SESSIONS for n in s)}
    for name, run in runs.items():
        if name != "single":
            assert_matches(
                runs["single"], run, f"{name} (NCCL, 1 rank, fp32)", later=ZERO_LATER if "deepspeed" in name else None
            )


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_every_strategy_at_world_size_1_matches_one_process_in_bf16_and_fp16(tmp_path, precision):
    """bf16: every strategy (FSDP2 with bf16 parameters and fp32 reduction, DeepSpeed's bf16 engine); fp16:
    torch's strategies with the GradScaler (DeepSpeed's fp16 has its own loss scaler). fp16 runs without
    clipping: see test_fp16_grad_scaler_skips_an_overflowed_step_on_every_rank_alike."""
    pytest.importorskip("deepspeed")
    sessions = WS1_SESSIONS if precision == "bf16-mixed" else WS1_SESSIONS[:1]
    runs = _ws1(tmp_path, precision, sessions, clip=1.0 if precision == "bf16-mixed" else None)
    assert set(runs) == {"single", *(n for s in sessions for n in s)}
    for name, run in runs.items():
        if name != "single":
            assert_matches(runs["single"], run, f"{name} (NCCL, 1 rank, {precision})", precision)
    assert runs["single"]["losses"][-1] < runs["single"]["losses"][0]  # it trains


# ---- two ranks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accumulating_references(tmp_path_factory):
    """One process accumulating the 2 ranks' micro-batches (this pytest process, on cuda:0), per precision."""
    root = tmp_path_factory.mktemp("reference")
    return {p: fit(root / p, "single", precision=p, accumulate=2, batch=BATCH // 2) for p in ("32-true", "bf16-mixed")}


TWO_RANK_RUNS = {
    "ddp": dict(strategy="ddp"),
    "fsdp": dict(strategy="fsdp"),
    # one model replica split over the 2 ranks: it accumulates both micro-batches, as the one process does
    "model_parallel": dict(strategy="model_parallel", accumulate=2),
}


@pytest.mark.parametrize("name", list(TWO_RANK_RUNS))
def test_two_ranks_ddp_fsdp_and_tensor_parallel_match_one_process(tmp_path, accumulating_references, name):
    """DDP, FSDP and TP=2 on 2 ranks (NCCL on 2 GPUs; on one GPU both ranks share cuda:0 under gloo). On one
    GPU FSDP and TP are refused before any rank starts: their DTensor collectives over gloo on CUDA tensors ended
    both ranks in SIGSEGV (torch 2.11, H200), so only DDP runs there.

    Which refusal comes first on one GPU: asked to start 2 ranks itself, the Trainer says the machine has 1 GPU
    (the fact a user can act on: devices=1); 2 ranks a launcher started on that GPU (torchrun --nproc-per-node 2,
    as run_ranks does) get the NCCL refusal, since the ranks exist and only the backend is wrong."""
    if TWO_RANK_BACKEND == "gloo" and name != "ddp":
        with pytest.raises(ValueError, match=rf"devices=2 but this machine has {GPUS} CUDA GPUs") as info:
            distrain.Trainer(accelerator="gpu", strategy=name, devices=2, logger=False, **TWO_RANKS)
        assert "\n" not in str(info.value)
        launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        with pytest.MonkeyPatch.context() as env:
            for key, value in {**launched, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
                env.setenv(key, value)
            with pytest.raises(ValueError, match="needs NCCL") as info:
                distrain.Trainer(accelerator="gpu", strategy=name, devices=2, logger=False, **TWO_RANKS)
        assert "\n" not in str(info.value)
        return
    runs = [(name, dict(devices=2, batch=BATCH // 2, **TWO_RANKS, **TWO_RANK_RUNS[name]))]
    results = run_ranks(session, 2, str(tmp_path), runs)
    assert_matches(accumulating_references["32-true"], results[0][name], f"{name} (2 ranks, {TWO_RANK_BACKEND})")
    assert results[1][name]["losses"] == results[0][name]["losses"]  # every rank logs the same reduced loss


@pytest.mark.skipif(
    CUDA and GPUS < 2, reason="a pipeline needs 2 GPUs: NCCL refuses 2 ranks on one GPU, gloo has no CUDA send/recv"
)
def test_pipeline_on_two_gpus_matches_one_process(tmp_path, accumulating_references):
    runs = [
        (schedule, dict(strategy="pipeline", schedule=schedule, devices=2, batch=BATCH // 2, accumulate=2))
        for schedule in ("1F1B", "GPipe")
    ]
    results = run_ranks(session, 2, str(tmp_path), runs)[0]
    for schedule, _ in runs:
        assert_matches(accumulating_references["32-true"], results[schedule], f"pipeline {schedule} (NCCL, 2 GPUs)")


# ---- precision -------------------------------------------------------------------------------------------------
def _overflow_run(rank, root, clip):
    try:
        return fit(
            root, "ddp", devices=2, precision="16-mixed", clip=clip, module_kw={"overflow_step": 2},
            inspect=("steps",), **TWO_RANKS,
        )  # fmt: skip
    except distrain.NonFiniteError as e:
        return {"error": str(e)}


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clipping", "clipping"])
def test_fp16_grad_scaler_skips_an_overflowed_step_on_every_rank_alike(tmp_path, clip):
    """fp16 autocast with torch's GradScaler on 2 DDP ranks: rank 1's loss overflows at step 2 (finite, but
    infinite once scaled by 65536). The all-reduced gradients are infinite on both ranks, so both scalers skip
    the step and halve the scale: the weights after step 2 are exactly those after step 1, on both ranks; step 3
    trains again; the ranks end identical."""
    ranks = run_ranks(_overflow_run, 2, str(tmp_path), clip)
    for rank, run in enumerate(ranks):
        assert "error" not in run, f"rank {rank}: the overflow stopped the run instead of being skipped: {run['error']}"
        params, scales = run["params"], run["scales"]
        assert scales == [65536.0, 32768.0, 32768.0, 32768.0], (rank, scales)  # halved once, at the overflow
        assert torch.equal(params[1], params[0]), f"rank {rank}: the overflowed step 2 changed the weights"
        assert not torch.equal(params[2], params[1]), f"rank {rank}: step 3 did not train"
        assert all(torch.isfinite(p).all() for p in params)
    assert torch.equal(ranks[0]["params"][-1], ranks[1]["params"][-1])  # the ranks agree


@pytest.mark.skipif(
    CUDA and GPUS < 2, reason="FSDP's collectives need 2 ranks under NCCL, which need 2 GPUs (world size 1 skips them)"
)
def test_fsdp_mixed_precision_gathers_bf16_parameters_and_reduces_in_fp32(tmp_path, accumulating_references):
    """bf16-mixed under FSDP2 on 2 ranks: the MixedPrecisionPolicy all-gathers parameters in bf16 (the forward
    sees bf16 weights), reduce-scatters gradients in fp32, and keeps the sharded parameters and AdamW's state in
    fp32; the losses stay within bf16's tolerance of one process."""
    run = run_ranks(
        session, 2, str(tmp_path),
        [("fsdp", dict(strategy="fsdp", devices=2, batch=BATCH // 2, precision="bf16-mixed",
                       module_kw={"probe": True}, inspect=("dtypes",), log_collectives=True, **TWO_RANKS))],
    )[0]["fsdp"]  # fmt: skip
    assert run["forward_weight_dtypes"] == ["torch.bfloat16"]
    assert run["gathered"] == ["torch.bfloat16"]
    assert run["reduced"] == ["torch.float32"] and run["reduce_scatters"] >= STEPS
    assert run["param_kinds"] == ["DTensor"] and run["param_dtypes"] == ["torch.float32"]
    assert run["state_dtypes"] == ["torch.float32"]
    assert_matches(accumulating_references["bf16-mixed"], run, "fsdp bf16 (2 ranks)", "bf16-mixed")


@pytest.mark.skipif(CUDA and GPUS < 2, reason="expert parallelism's all-to-all on CUDA needs NCCL: 2 GPUs")
def test_expert_parallel_on_two_gpus_in_fp16_and_bf16(tmp_path):
    """The GPT with 4 experts per block, each GPU 2 of them, every step clipped: under DDP in fp16 (the GradScaler
    unscales the gradients once: the expert-aware norm once reached them through a second unscale_, torch's
    'already been called' error) and under FSDP in bf16, each within its precision's tolerance of one process."""
    moe = {"module_kw": {"n_experts": 4}, "clip": 0.3}
    references = {p: fit(tmp_path / f"single-{p}", "single", precision=p, accumulate=2, batch=BATCH // 2, **moe)
                  for p in ("16-mixed", "bf16-mixed")}  # fmt: skip
    two = dict(devices=2, batch=BATCH // 2, expert_parallel_size=2, **moe)
    runs = run_ranks(
        session, 2, str(tmp_path),
        [("ddp-fp16", dict(strategy="ddp", precision="16-mixed", **two)),
         ("fsdp-bf16", dict(strategy="fsdp", precision="bf16-mixed", **two))],
    )[0]  # fmt: skip
    assert_matches(references["16-mixed"], runs["ddp-fp16"], "ddp + experts over 2 (fp16)", "16-mixed")
    assert_matches(references["bf16-mixed"], runs["fsdp-bf16"], "fsdp + experts over 2 (bf16)", "bf16-mixed")


@pytest.mark.skipif(CUDA and GPUS < 2, reason="tensor parallelism, pipelines and all-to-alls on CUDA need NCCL: 2 GPUs")
def test_a_mixture_of_experts_under_model_parallel_on_two_gpus_in_bf16(tmp_path):
    """The GPT with 4 experts per block, bf16, every step clipped, each layout within bf16's tolerance of one process
    accumulating the same global batch: each expert's hidden units split over the 2 GPUs (each GPU's grouped matmul
    on its units' DTensor shards), 2 pipeline stages sending the balance loss's running sum (a 0-d tensor) beside the
    activations, and the experts split between 2 context-parallel ranks (the all-to-all under NCCL)."""
    moe = {"module_kw": {"n_experts": 4}, "clip": 0.3, "precision": "bf16-mixed"}
    reference = fit(tmp_path / "single", "single", accumulate=2, batch=BATCH // 2, **moe)
    two = dict(devices=2, batch=BATCH // 2, accumulate=2, **moe)
    runs = run_ranks(
        session, 2, str(tmp_path),
        [("tp2", dict(strategy="model_parallel", tensor_parallel_size=2, **two)),
         ("pp2", dict(strategy="pipeline", schedule="1F1B", **two)),
         ("cp2+ep2", dict(strategy="model_parallel", tensor_parallel_size=1, context_parallel_size=2,
                          expert_parallel_size=2, **two))],
    )[0]  # fmt: skip
    for name, run in runs.items():
        assert_matches(reference, run, f"{name}, a mixture of experts (bf16, 2 GPUs)", "bf16-mixed")


def test_experts_run_one_grouped_matmul_on_cuda_in_bf16_with_the_loops_results():
    """On CUDA in bf16 a mixture of experts' stacked experts run as one grouped matmul (``F.grouped_mm``) instead of a
    matmul per expert: the same outputs and gradients within bf16's rounding, an expert with no token included."""
    from distrain.models import moe

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's grouped matmul needs compute capability 8.0+")
    torch.manual_seed(0)
    tokens = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = [10, 0, 25, 5]
    assert moe._grouped_mm_applies(tokens, weight, torch.bfloat16)
    grouped = moe.grouped_linear(tokens, weight, counts)
    (grouped.float() ** 2).sum().backward()
    grads = tokens.grad.clone(), weight.grad.clone()
    tokens.grad = weight.grad = None
    loop = torch.cat([g @ weight[e].t() for e, g in enumerate(tokens.split(counts))])
    (loop.float() ** 2).sum().backward()
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, (tokens.grad, weight.grad)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-1)
    assert weight.grad[1].abs().sum() == 0  # the expert no token chose


def test_low_precision_norms_keep_what_the_planner_says_on_cuda(tmp_path):
    """On CUDA, Hugging Face's RMSNorm keeps an fp32 copy of its input for the backward and torch's fused
    ``rms_norm`` in bf16 does not (``training.low_precision_norms``): the saving is 4 bytes per token and hidden unit
    per norm, and the planner's GPU trace (``planner.fake.norms_as_on_cuda``) counts the same, within 10%."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distrain.models.norms import low_precision_norms
    from distrain.planner import ModelSpec
    from distrain.planner.model_stats import trace_step

    h, layers, b, t = 1024, 4, 4, 1024
    config = LlamaConfig(
        hidden_size=h, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=t, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    ids = torch.randint(0, 1024, (b, t), device="cuda")

    def kept(low: bool) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        if low:
            assert len(low_precision_norms(model)) == 2 * layers + 1
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = model.model(input_ids=ids).last_hidden_state  # the kept activations, at the end of forward
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before
        hidden.float().sum().backward()
        del model, hidden
        torch.cuda.empty_cache()
        return used

    measured = kept(False) - kept(True)
    expected = 4 * b * t * h * (2 * layers + 1)
    assert abs(measured - expected) <= 0.1 * expected, (measured, expected)
    spec = ModelSpec.huggingface(str(tmp_path), t, "causal_lm")
    bf16 = dict(param_dtype=torch.bfloat16, autocast=torch.bfloat16, foreach=True)
    own, low = (trace_step(s, b, **bf16).activations for s in (spec, spec.with_low_precision_norms()))
    planned = own - low
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)


def _needs_fp8():
    if torch.cuda.get_device_capability() < (8, 9):  # asked here: importing this module must not start CUDA
        pytest.skip("fp8 training needs compute capability 8.9+ (H100, H200, L4)")
    pytest.importorskip("torchao", reason="fp8 needs torchao: pip install 'distrain[fp8]'")


def test_fp8_step_holds_what_the_planner_traced_on_the_cpu():
    """precision='fp8' is planned by tracing torchao's float8 layers under fake tensors on the CPU
    (``trace_step(float8=True)``). On CUDA, one step's peak above the parameters (activations, their gradients and
    the parameter gradients stored so far: the trace's ``activations_and_grads``) is the plan's within 10%, in fp8
    as in bf16-mixed."""
    _needs_fp8()
    from distrain.module import loss_of, run_step
    from distrain.planner import ModelSpec
    from distrain.planner.model_stats import set_up_module, trace_step
    from distrain.strategies.sharded_init import to_empty_keeping_ties

    spec, b = ModelSpec.builtin_gpt("gpt-124m", 1024), 8
    for float8 in (False, True):
        module, _ = set_up_module(spec, torch.float32, 0, float8=float8)
        to_empty_keeping_ties(module, "cuda")
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        batch = tuple(t.cuda() for t in spec.make_batch(b))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(run_step(module, "training_step", batch, 0))
        loss.backward()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        del module, batch, loss
        gc.collect()
        torch.cuda.empty_cache()
        trace = trace_step(spec, b, autocast=torch.bfloat16, foreach=True, float8=float8)
        planned = trace.activations_and_grads
        assert abs(planned - measured) <= 0.1 * measured, (float8, planned, measured)
        if float8:
            assert trace.work.forward_backward.float8_flops > 0


def test_fp8_trains_close_to_bf16_and_fsdp_matches_it(tmp_path):
    """precision='fp8' (torchao, dynamic scales): every linear but the head becomes Float8Linear, the losses
    stay within 5e-2 of bf16's and go down; FSDP2 (world size 1) converts the same linears and matches one fp8
    process. FSDP2 skips its all-gather at world size 1 (torch 2.11 and 2.13), so the float8 all-gather itself
    is checked on 2 GPUs (the next test)."""
    _needs_fp8()
    runs = run_ranks(
        session, 1, str(tmp_path),
        [("single-bf16", dict(strategy="single", precision="bf16-mixed")),
         ("single-fp8", dict(strategy="single", precision="fp8", inspect=("float8",))),
         ("fsdp-fp8", dict(strategy="fsdp", precision="fp8", inspect=("float8",)))],
    )[0]  # fmt: skip
    linears = [f"gpt.blocks.{i}.{name}" for i in range(2) for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    assert runs["single-fp8"]["float8"] == linears and runs["fsdp-fp8"]["float8"] == linears
    bf16, fp8 = runs["single-bf16"]["losses"], runs["single-fp8"]["losses"]
    assert all(abs(a - b) <= 5e-2 * a for a, b in zip(bf16, fp8)), (bf16, fp8)
    assert fp8[-1] < fp8[0]
    assert_matches(runs["single-fp8"], runs["fsdp-fp8"], "fsdp fp8 (1 rank)", "bf16-mixed")


@pytest.mark.skipif(
    CUDA and GPUS < 2, reason="FSDP's all-gather needs 2 ranks under NCCL, which need 2 GPUs (world size 1 skips it)"
)
def test_fsdp_all_gathers_float8_weights_on_two_gpus(tmp_path):
    """Under FSDP2 on 2 ranks the block weights travel as float8 bytes: fewer bytes than bf16's all-gather."""
    _needs_fp8()
    two = dict(strategy="fsdp", devices=2, batch=BATCH // 2, log_collectives=True)
    runs = run_ranks(
        session, 2, str(tmp_path),
        [("fsdp-bf16", dict(precision="bf16-mixed", **two)),
         ("fsdp-fp8", dict(precision="fp8", inspect=("float8",), **two))],
    )[0]  # fmt: skip
    assert "torch.uint8" in runs["fsdp-fp8"]["gathered"]  # float8 data (with bf16 norms: gathered as bytes)
    assert runs["fsdp-bf16"]["gathered"] == ["torch.bfloat16"]
    ratio = runs["fsdp-fp8"]["gathered_bytes"] / runs["fsdp-bf16"]["gathered_bytes"]
    assert 0.3 < ratio < 0.75, ratio  # ~0.58 for this model: block linears 1 byte instead of 2, the rest as bf16


# ---- DeepSpeed's CUDA ops and CPU-Adam offload -------------------------------------------------------------------
def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


def test_deepspeed_cpu_adam_offload_pins_host_memory(fp32_world_size_1):
    """ZeRO-2 and ZeRO-3 with CPU offload on CUDA: DeepSpeed's CPU Adam steps the offloaded fp32 state, the
    host buffers are pinned (config, optimizer, and every ZeRO-3 parameter partition lives pinned on the host);
    parity with one process is in the fp32 test above."""
    for name in ("deepspeed_stage_2_offload", "deepspeed_stage_3_offload"):
        run = fp32_world_size_1[name]
        assert run["optimizer"] == "DeepSpeedCPUAdam", (name, run["optimizer"])
        assert run["pin_in_config"] and all(v is True for v in run["pin_in_config"].values()), (name, run)
    stage3 = fp32_world_size_1["deepspeed_stage_3_offload"]
    assert stage3["pin_in_config"].keys() == {"offload_optimizer", "offload_param"}
    assert stage3["optimizer_pinned"] is True
    assert stage3["param_partitions"] == [("cpu", True)], stage3["param_partitions"]


def test_deepspeed_without_offload_steps_with_its_fused_adam_cuda_op(fp32_world_size_1):
    if _nvcc() is None:
        pytest.skip("DeepSpeed JIT-builds FusedAdam with nvcc; no CUDA toolkit here (CUDA_HOME/bin/nvcc)")
    for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"):
        run = fp32_world_size_1[name]
        assert run["optimizer"] == "FusedAdam", (name, run["optimizer"])
        assert run["param_partitions"] in ([], [("cuda", False)]), (name, run["param_partitions"])  # nothing offloaded


# ---- torch.compile on CUDA -----------------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_compile_on_cuda_matches_eager(tmp_path):
    """Inductor's CUDA kernels: the whole model under single, each block under FSDP (world size 1, NCCL); the
    losses and gradient norms within 1e-4 of eager."""
    runs = run_ranks(
        session, 1, str(tmp_path),
        [("eager", dict(strategy="single")),
         ("single", dict(strategy="single", compile=True, inspect=("compiled",))),
         ("fsdp", dict(strategy="fsdp", compile=True, inspect=("compiled",)))],
    )[0]  # fmt: skip
    assert runs["single"]["compiled"] == ["gpt"]
    assert runs["fsdp"]["compiled"] == ["gpt.blocks.0", "gpt.blocks.1"]
    for name in ("single", "fsdp"):
        assert_matches(runs["eager"], runs[name], f"{name} compiled", first=1e-4, later=1e-4)


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 2e-2)], ids=["fp32", "bf16"])
def test_ring_attention_on_cuda_matches_whole_sequence_attention(dtype, tolerance):
    """``parallel/ring_attention.py``'s ring with CUDA's memory-efficient kernel: its forward and backward keyword
    plumbing (the kernel's log-sum-exp and philox outputs handed to its backward) on one GPU, a group of one; the ring
    itself between two GPUs under NCCL where there are two (on a CPU the same ring is tested on gloo)."""
    from test_context_parallel import _ring_against_whole_attention

    world = 2 if GPUS >= 2 else 1
    for rank, errors in enumerate(run_ranks(_ring_against_whole_attention, world, world, True, "cuda", dtype)):
        assert max(errors) < tolerance, (rank, errors)


def test_the_planner_simulates_fsdp_and_tensor_parallelism_in_a_process_that_has_used_cuda():
    """``distrain verify --strategy fsdp`` on a GPU printed "the memory planner could not plan this run
    (AcceleratorError: CUDA error: initialization error)": the simulation's child was forked from a process that had
    touched CUDA. Where a GPU is present the child is a fresh interpreter that sees none; here, after this process
    has run a CUDA kernel, FSDP's and tensor parallelism's simulations give the numbers a CPU machine's do."""
    from distrain.planner import Estimator, Job, ModelSpec, Option
    from distrain.planner.simulate import Started, _machine_has_gpu

    assert torch.ones(2, device="cuda").sum().item() == 2
    assert _machine_has_gpu() and Started.fresh is None
    estimator = Estimator(Job(ModelSpec.builtin_gpt("gpt-tiny", 64), 2, world_size=2, gpu=True))
    fsdp = estimator.estimate(Option("fsdp", sharding="FULL_SHARD"))
    tensor = estimator.estimate(Option("tp", tensor=2, sequence_parallel=True))
    whole = estimator.estimate(Option("ddp"))
    assert 0 < fsdp.params < whole.params and 0 < tensor.params < whole.params, (fsdp, tensor, whole)
