"""DeepSpeed ZeRO stages 1–3 with CPU/NVMe offload, on the real ``deepspeed`` engine.

The engine owns what the other strategies leave to the loop: it reduces and partitions
gradients, clips, steps the (possibly offloaded) optimizer and its own LR scheduler. The loop
still decides *when*: every micro-step tells the engine whether it ends an accumulation window
(``set_gradient_accumulation_boundary``), so the Trainer's accumulation schedule stays the one
source of truth, and ``backward`` runs with ``scale_wrt_gas=False`` because the Trainer already
divided the loss.

Checkpoints are the engine's own shard files (each rank writes its partition) inside distrain's
contract: an atomically committed directory with ``meta.pt`` holding progress, RNG and the rest.
Everything is read back with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain import compat, distributed
from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import safe_load
from distrain.checkpoint import state as ckpt_state
from distrain.config import ConfigError
from distrain.strategies import sharded_init
from distrain.strategies.base import LoopFacts, SetUp, Strategy, Traits
from distrain.strategies.deepspeed_config import (
    PRESETS,
    TrainingFacts,
    check_precision,
    fill_config,
    options_config,
    read_user_config,
    zero_stage,
)
from distrain.strategies.layers import SELECTIVE_NOT_WITH_DEEPSPEED, hidden_size_of, is_selective, selected_layers
from distrain.strategies.registry import register


class DeepSpeedStrategy(Strategy):
    """DeepSpeed's ZeRO (``stage`` 0 to 3) on its own engine, with CPU or NVMe offload of the optimizer
    (``offload_optimizer``) and the parameters (``offload_parameters``). ``config``: a DeepSpeed JSON config (a dict
    or a path), which then decides, in place of the options; ``auto_values``: values for its ``"auto"`` keys that
    only the caller knows. ``save_full_weights``: each checkpoint also holds a consolidated fp32
    ``model.safetensors``. The engine reduces, clips and steps; the Trainer still decides when a step ends."""

    start_method = "popen"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        remote_device: str | None = None,
        offload_params_device: str = "cpu",
        offload_optimizer_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        cpu_checkpointing: bool = False,
        partition_activations: bool = False,
        allgather_bucket_size: int | float | str = 200_000_000,
        reduce_bucket_size: int | float | str = 200_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        config: dict | str | os.PathLike | None = None,
        save_full_weights: bool = False,
        logging_level: int = logging.WARNING,
        auto_values: dict[str, Any] | None = None,
        activation_checkpointing_policy: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
    ):
        super().__init__(process_group_backend, timeout, activation_checkpointing_policy, collective_timeout)
        if is_selective(activation_checkpointing_policy):  # its checkpointing is its own, reentrant, whole layers
            raise ValueError(SELECTIVE_NOT_WITH_DEEPSPEED)
        user, self.config_source = read_user_config(config)
        if user is None:
            user = options_config(
                stage,
                offload_optimizer,
                offload_parameters,
                offload_optimizer_device,
                offload_params_device,
                nvme_path,
                allgather_bucket_size,
                reduce_bucket_size,
                contiguous_gradients,
                overlap_comm,
                partition_activations,
                cpu_checkpointing,
            )
        else:  # the file is the source of truth; these two only make DeepSpeed accept a torch optimizer quietly
            user.setdefault("zero_allow_untested_optimizer", True)
            user.setdefault("steps_per_print", 10**12)
        self.config = user
        self.stage = zero_stage(user)
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_optimization.stage must be 0, 1, 2 or 3 (in {self.config_source}), got {self.stage}"
            )
        self.remote_device = remote_device
        self.save_full_weights = save_full_weights
        self.logging_level = logging_level
        #: values for "auto" keys only the caller knows, by leaf name (warmup_num_steps defaults to
        #: the module's ``warmup_steps`` hyperparameter)
        self.auto_values = dict(auto_values or {})
        self.filled_config: dict | None = None
        self.engine = None
        self._trains = False  # the engine has an optimizer (not set up for evaluation only)
        self._rng_before_init: dict | None = None

    def connect(self, accelerator, precision, cluster, nprocs: int, num_nodes: int):
        super().connect(accelerator, precision, cluster, nprocs, num_nodes)
        if precision.name == "64-true":  # as Lightning's DeepSpeed strategy refuses it
            raise ValueError(
                "precision='64-true' under DeepSpeed: its engine trains in fp32, fp16 or bf16, not float64; use "
                "strategy='ddp' or 'fsdp' for 64-true"
            )
        _check_nvme_offload(self.config, self.config_source)  # on the machine that runs it, not one that plans it
        # the file's precision against the Trainer's (fp16 needs a GPU): refused here, before any rank starts
        check_precision(copy.deepcopy(self.config), precision.name, accelerator.name == "cuda", self.config_source)

    @property
    def planned_as(self) -> tuple[str, dict[str, Any]]:
        # its stage and offload, as the planner reads a user's JSON (``planner/models/zero.py``)
        return "deepspeed", {"configured": {"zero": {"json": self.config}}}

    @property
    def traits(self) -> Traits:
        """Forwards communicate at ZeRO-3; the engine skips a step whose gradients are not finite (stage > 0, or
        as the engine reports once it is built); no ``torch.compile``, no fp8, no checkpoints written in the
        background, no re-run steps."""
        return Traits(
            collective_forward=self.stage == 3,  # partitioned parameters are all-gathered in every forward
            # ZeRO's optimizers (and DeepSpeed's fp16/bf16 wrappers) skip a step whose gradient norm is not finite;
            # stage 0 in fp32 steps a plain torch optimizer: no norm, no check (known once the engine exists)
            engine_skips_nonfinite=getattr(self, "_engine_checks_steps", self.stage > 0),
            compiles=False,  # ZeRO-3's gather hooks sit on every layer; DeepSpeed's own engine.compile is not wired in
            converts_fp8=False,  # the engine owns the model's dtypes; torchao's float8 layers are not wired in
            saves_in_background=False,  # the engine writes its own checkpoint files, synchronously
            reruns_steps=False,  # its engine counts every backward towards its accumulation boundary
            runs_module_backward=False,  # engine.backward runs it
            optimizer_holds_parameters=self.stage != 3,  # ZeRO-3's optimizer steps flat partitions
        )

    @property
    def _offload_optimizer(self) -> bool:
        device = self.config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        return device in ("cpu", "nvme")

    # ---- set-up ----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        _quiet_deepspeed(self.logging_level, self.accelerator.name)
        super().setup_environment()  # the torch process group (gloo on CPU) first, as DeepSpeed needs
        # ZeRO-3 reads os.environ["LOCAL_RANK"] itself, at zero.Init and in its steps (the device of its checks); a
        # one process run no launcher started has none. It stays, as the process group does: alone it makes no
        # later run in this process look launched (detect_cluster wants RANK, WORLD_SIZE and MASTER_* too).
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        compat.cpu_info_asked_once()
        compat.deepspeed_forget_ended_groups()  # a group of an earlier run in this process is gone
        import deepspeed

        with compat.deepspeed_without_shm_op():  # adopts the existing group
            deepspeed.init_distributed(
                dist_backend=self.backend, dist_init_required=False, verbose=False, timeout=self.timeout
            )

    def module_init_context(self, empty_init: bool | None = None):
        """Under ZeRO-3, ``configure_model`` runs in ``deepspeed.zero.Init``: each layer is
        partitioned across ranks as soon as it is built, so no rank ever holds the whole model."""
        if self.stage != 3:
            return super().module_init_context(empty_init)
        return self._zero_init()

    @contextlib.contextmanager
    def _zero_init(self):
        import deepspeed

        self._rng_before_init = sharded_init.record_rng()
        offload = self.config.get("zero_optimization", {}).get("offload_param") or {}
        offloaded = offload.get("device") in ("cpu", "nvme")
        zero = {"stage": 3}
        if offloaded:
            zero["offload_param"] = {
                "device": offload["device"],
                "nvme_path": offload.get("nvme_path", "/local_nvme"),
                "pin_memory": self.root_device.type == "cuda",
            }
        # The dtype goes through the config: zero.Init's own ``dtype`` argument is ignored on
        # accelerators without fp16 (it builds in bf16 on CPU whatever is asked, deepspeed 0.19).
        bf16 = self.precision.name.startswith("bf16") or self.config.get("bf16", {}).get("enabled") is True
        init_config = {  # zero.Init reads the partitioning and dtype; the batch keys just have to be valid
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": self.world_size,
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
        }
        remote = self.remote_device or (offload["device"] if offloaded else None)
        # zero.Init replaces torch.Tensor.__new__; an import inside it that defines tensor subclasses fails
        # ("Signature mismatch ... tensor_pynew"): transformers imports torch._dynamo lazily, on a model's first build
        import torch._dynamo  # noqa: F401

        with deepspeed.zero.Init(config_dict_or_path=init_config, remote_device=remote), sharded_init.deferred():
            yield

    def _setup_module(self, module: nn.Module) -> nn.Module:
        partitioned = [hasattr(p, "ds_id") for p in module.parameters()]
        if any(partitioned) and not all(partitioned):
            whole = [name for name, p in module.named_parameters() if not hasattr(p, "ds_id")]
            raise ValueError(
                f"{type(module).__name__}: ZeRO-3 partitioned the layers built in configure_model, but not "
                f"{', '.join(whole[:3])}{' …' if len(whole) > 3 else ''}: built in __init__, or copies made with "
                "copy.deepcopy (torch's TransformerEncoder/TransformerDecoder copy the layer they are given), which "
                "DeepSpeed's zero.Init does not partition. Build every layer in configure_model without copies, or "
                "all of them in __init__"
            )
        if not any(partitioned):  # built in __init__: its weights are final (the engine starts from rank 0's)
            self._rng_before_init = None
        if self._rng_before_init is not None:
            # zero.Init partitions each layer when its ``__init__`` returns, so a parent that
            # initializes its children's weights in its own ``__init__`` (GPT-2 style) wrote into
            # empty partitions: replay the initialization from the RNG state construction began with,
            # one gathered module at a time (sharded_init)
            rng, self._rng_before_init = self._rng_before_init, None
            unit_of = sharded_init.units_of_parameters(module)
            sharded_init.replay_initialization(module, rng, _GatheredPartitions(), unit_of)
        else:
            module = module.to(self.root_device)
        self._checkpoint_activations(module)
        return module

    def _checkpoint_activations(self, module: nn.Module) -> None:
        """DeepSpeed's activation checkpointing (CPU offload / partitioning of the saved inputs)
        on the layers the usual policy selects; the layers keep their names in the state dict."""
        policy = self.activation_checkpointing_policy
        section = self.config.get("activation_checkpointing") or {}
        if not policy:
            return
        import deepspeed

        layers = selected_layers(module, policy)
        deepspeed.checkpointing.configure(
            None,
            partition_activations=bool(section.get("partition_activations", False)),
            checkpoint_in_cpu=bool(section.get("cpu_checkpointing", False)),
            contiguous_checkpointing=bool(section.get("contiguous_memory_optimization", False)),
            # contiguous buffers need the count; "null" (the spec's) means: the layers checkpointed here
            num_checkpoints=section.get("number_checkpoints") or len(layers),
            synchronize=bool(section.get("synchronize_checkpoint_boundary", False)),
            profile=bool(section.get("profile", False)),
        )
        for layer in layers:
            layer.forward = _deepspeed_checkpointed(layer.forward)

    def _setup_training(self, module: nn.Module, optimizers: list, schedulers: list, loop: LoopFacts) -> SetUp:
        """The engine over the model and the optimizer. A loop of your own calls backward and step itself:
        the micro-batch size in the config is bookkeeping only there."""
        facts = TrainingFacts(
            micro_batch_size=loop.micro_batch_size,
            accumulate=loop.accumulate,
            world_size=self.world_size,
            gradient_clip_val=loop.gradient_clip_val,
            precision=self.precision.name,
            on_cuda=self.root_device.type == "cuda",
            total_steps=loop.total_steps,
            hidden_size=hidden_size_of(module),
            optimizer_defaults=_optimizer_settings(optimizers[0]) if optimizers else None,
        )
        self.filled_config = fill_config(
            self.config, facts, self.config_source, {**_values_from_hyperparameters(module), **self.auto_values}
        )
        optimizer, schedulers = self._choose_optimizer(optimizers, schedulers)
        cfg = self.filled_config
        self._trains = optimizer is not None or "optimizer" in cfg
        import deepspeed

        # the config's optimizer is built over these; without one (evaluation) there is none to build
        params = (
            [p for p in module.parameters() if p.requires_grad] if optimizer is None and "optimizer" in cfg else None
        )
        with _without_torch_deprecations():
            self.engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=module,
                optimizer=optimizer,
                model_parameters=params,
                config=copy.deepcopy(cfg),
                dist_init_required=False,
            )
        safe_load.deepspeed_checkpoint_engine_loads_safely(self.engine)  # DeepSpeed's own load unpickles anything
        self._engine_checks_steps = hasattr(self.engine.optimizer, "_global_grad_norm")
        if loop.run_dir is not None and self.is_global_zero:
            Path(loop.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(loop.run_dir) / "deepspeed_config.json").write_text(json.dumps(self.filled_config, indent=2) + "\n")
        return SetUp(self.engine, [ds_optimizer] if ds_optimizer is not None else [], schedulers)

    def _choose_optimizer(self, optimizers: list, schedulers: list[dict]):
        """One optimizer: the config's, or the client's (swapped for DeepSpeed's CPU Adam under
        optimizer offload, FusedAdam on CUDA)."""
        cfg = self.filled_config
        if len(optimizers) > 1:
            raise ValueError(f"DeepSpeed steps exactly one optimizer; configure_optimizers gave {len(optimizers)}")
        client = optimizers[0] if optimizers else None
        if "optimizer" in cfg:
            if schedulers and "scheduler" not in cfg:
                raise ValueError(
                    f"{self.config_source} defines the optimizer, so the LR scheduler from "
                    'configure_optimizers has no optimizer to drive; add a "scheduler" section to the '
                    'config or remove its "optimizer" section'
                )
            if client is not None and self.is_global_zero:
                print(
                    f"distrain: the optimizer ({cfg['optimizer'].get('type')}) and LR scheduler come from "
                    f"{self.config_source}; configure_optimizers' {type(client).__name__} is not used",
                    flush=True,
                )
            return None, []
        if client is None:  # evaluation only: an engine without optimizer (ZeRO-3 still gathers in forward)
            return None, []
        if "scheduler" in cfg and schedulers:
            raise ValueError(f"both configure_optimizers and {self.config_source} define an LR scheduler; keep one")
        native = self._native_optimizer(client)
        if native is not None:
            for config in schedulers:  # the schedulers were built on the optimizer being replaced
                config["scheduler"].optimizer = native
                # torch checks on its first step() that the optimizer's step is the one it wrapped at
                # construction; it was, on the replaced optimizer: skip that check, not the step
                config["scheduler"]._step_count = max(config["scheduler"]._step_count, 2)
            return native, schedulers
        if self._offload_optimizer:  # a torch optimizer on offloaded states: allowed, but slower
            cfg["zero_force_ds_cpu_optimizer"] = False
        return client, schedulers

    def _native_optimizer(self, client: torch.optim.Optimizer):
        if (
            type(client) not in (torch.optim.Adam, torch.optim.AdamW)
            or client.defaults.get("amsgrad")
            or client.defaults.get("maximize")
        ):
            return None
        groups = [{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")} for g in client.param_groups]
        d = client.defaults
        adamw = type(client) is torch.optim.AdamW
        if self._offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            with compat.deepspeed_parsable_arch_list():  # its op builds here, with CUDA's flags where there is CUDA
                return DeepSpeedCPUAdam(
                    groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"], adamw_mode=adamw
                )
        if self.root_device.type == "cuda":
            try:
                from deepspeed.ops.adam import FusedAdam

                with compat.deepspeed_parsable_arch_list():  # its op builds here
                    return FusedAdam(
                        groups,
                        lr=d["lr"],
                        betas=d["betas"],
                        eps=d["eps"],
                        weight_decay=d["weight_decay"],
                        adam_w_mode=adamw,
                    )
            except Exception as e:  # no CUDA toolchain to build it: torch's optimizer works too
                warnings.warn(f"DeepSpeed FusedAdam unavailable ({e}); using {type(client).__name__}", stacklevel=2)
        return None

    # ---- the step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: nn.Module | None = None) -> None:
        """``engine.backward(loss)``, not divided again by the accumulation (the loop already divided the loss)."""
        with _without_torch_deprecations():
            self.engine.backward(loss, scale_wrt_gas=False)  # the loop already divided by the accumulation

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        # ZeRO partitions gradients as they are produced; what the loop controls is the boundary
        self.engine.set_gradient_accumulation_boundary(not enabled)
        return contextlib.nullcontext()

    def clip_gradient_values(self, module: nn.Module, optimizer, clip_value: float):
        raise ValueError(
            "gradient_clip_algorithm='value' under DeepSpeed: the engine clips by the gradients' norm only "
            "(gradient_clip_val, its config's gradient_clipping), as in Lightning"
        )

    def clip_gradients(self, module: nn.Module, optimizer, max_norm: float):
        """The engine clips, inside its step, to ``gradient_clipping`` from its config: ``max_norm`` must be that
        value (a ValueError otherwise). Returns the gradient norm, read from the engine once it has stepped; where
        the engine does not check steps (a plain torch optimizer), clips as ``Strategy.clip_gradients``."""
        clipping = self.filled_config.get("gradient_clipping", 0.0)
        if float(max_norm) != float(clipping):
            raise ValueError(
                f"clip to {max_norm}: under DeepSpeed the engine clips, to gradient_clipping={clipping} "
                "from its config; set that value instead"
            )
        if (
            not self._engine_checks_steps
        ):  # a plain optimizer's whole gradients: torch's clip (the engine's is a no-op after)
            return super().clip_gradients(module, optimizer, max_norm)
        return _NormAfterStep(self.engine)  # clipped inside engine.step(), across the partitions

    def gradient_norm(self, module: nn.Module, optimizer):
        if not self._engine_checks_steps:
            return super().gradient_norm(module, optimizer)
        return _NormAfterStep(self.engine)  # the engine computes it inside step(), across the partitions

    def optimizer_step(self, optimizer, module: nn.Module | None = None) -> None:
        """``engine.step()``: the engine steps the optimizer it holds (``optimizer`` is not used)."""
        with _without_torch_deprecations():
            self.engine.step()

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module inside the DeepSpeed engine (``module`` itself when it is not the engine)."""
        return module.module if module is self.engine else module

    # ---- what a rank holds: ZeRO keeps partitions (DeepSpeed's own accessors gather them) ----------------------
    def full_shape(self, param: torch.Tensor) -> torch.Size:
        return sharded_init.built_shape(param)  # ZeRO-3: the parameter itself is an empty placeholder

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        return getattr(param, "ds_tensor", param)  # ZeRO-3: this rank's partition

    def holds_whole(self, param: torch.Tensor) -> bool:
        return not hasattr(param, "ds_id") and super().holds_whole(param)

    def full_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master, gathered from the partitions (the parameter itself where the engine keeps none)."""
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
        return full.detach() if full is not None else super().full_parameter(param)

    def full_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """ZeRO keeps gradients in its partitions: gathered from there (stage 0: the parameter's own)."""
        from deepspeed.utils import safe_get_full_grad

        full = safe_get_full_grad(param)
        return full if full is not None else super().full_gradient(param)

    def reduce_dtype(self, model: nn.Module, module: nn.Module) -> torch.dtype:
        return self.engine.communication_data_type if self.engine is not None else super().reduce_dtype(model, module)

    def master_weights(self, optimizer) -> list[torch.Tensor]:
        """ZeRO steps flat fp32 partitions, and empties the inner optimizer's groups between steps."""
        masters = getattr(optimizer, "fp32_partitioned_groups_flat", None) or getattr(
            optimizer, "single_partition_of_fp32_groups", None
        )
        return list(masters) if masters else super().master_weights(optimizer)

    # ---- checkpoints ---------------------------------------------------------------------------
    def _engine_keys(self, state: dict[str, Any]) -> list[str]:
        """The entries the engine saves itself: the model and its optimizer."""
        opt = self.engine.optimizer if self.engine is not None else None

        def is_engine_owned(v: Any) -> bool:
            if isinstance(v, nn.Module):
                return True
            items = v if isinstance(v, (list, tuple)) else [v]
            return opt is not None and any(o is opt for o in items)

        return [k for k, v in state.items() if is_engine_owned(v)]

    def save_checkpoint(self, path, state: dict[str, Any], background: bool = False):
        if background:
            raise ValueError("asynchronous checkpoints are not supported with DeepSpeed (traits.saves_in_background)")
        keys = self._engine_keys(state)
        rest = ckpt_state.state_of({k: v for k, v in state.items() if k not in keys}, self.unwrap, ckpt_state.FULL)
        model = next((state[k] for k in keys if isinstance(state[k], nn.Module)), None)
        rest[ckpt_state.DEEPSPEED_META] = {
            "world_size": self.world_size,
            "stage": self.stage,
            "module_prefix": _prefix_of(self.unwrap(model) if model is not None else None, self.engine.module),
            "optimizer_swapped": self._swaps_optimizer(),
        }

        def write(tmp: Path) -> list[Path]:
            with _without_torch_deprecations(), _recording_saves(self.engine.checkpoint_engine) as written:
                self.engine.save_checkpoint(str(tmp), tag=ckpt_state.DEEPSPEED_TAG, client_state={}, save_latest=False)
            swapped = self._swapped_optimizer_state()  # every rank: DeepSpeed's gathers are collectives
            if self.is_global_zero:
                if swapped is not None:
                    torch.save(swapped, tmp / ckpt_state.SWAPPED_FILE)
                    written.append(tmp / ckpt_state.SWAPPED_FILE)
                torch.save(rest, tmp / ckpt_state.META_FILE)
                # and what the engine copies beside its files (zero_to_fp32.py)
                written += [tmp / ckpt_state.META_FILE, *(tmp / ckpt_state.DEEPSPEED_TAG).glob("*.py")]
            return written

        ckpt_io.write_checkpoint(
            path,
            write,
            self.is_global_zero,
            self.all_gather_object,
            finish=_write_full_weights if self.save_full_weights else None,
        )

    def load_checkpoint(self, path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        path = ckpt_io.resolve_checkpoint(path)
        keys = self._engine_keys(state)
        if not ckpt_state.is_deepspeed_checkpoint(path):
            return self._load_foreign(path, state, keys, strict)
        meta = ckpt_state.read_checkpoint_meta(path)
        saved = meta.get(ckpt_state.DEEPSPEED_META, {})
        wants_optimizer = any(not isinstance(state[k], nn.Module) for k in keys)
        if not self._trains:  # no engine, or one set up for evaluation: the consolidated weights
            if wants_optimizer:
                raise RuntimeError("resuming a DeepSpeed checkpoint needs the engine: call setup (or fit) first")
            return self._load_foreign(path, state, keys, strict)
        if wants_optimizer and (self._swaps_optimizer() or saved.get("optimizer_swapped")):
            import deepspeed

            raise ckpt_io.CheckpointError(
                f"{path}: a resume with the optimizer offloaded to NVMe would not be exact: DeepSpeed "
                f"{deepspeed.__version__} keeps the optimizer's fp32 state in swap files its checkpoints do not hold, "
                "and drops it on load (deepspeed#2082, #4416); start a new run from the checkpoint's weights "
                "(distrain convert, or Module.load_from_checkpoint) or resume without NVMe optimizer offload"
            )
        reshard = wants_optimizer and saved.get("world_size") != self.world_size
        with contextlib.ExitStack() as stack:
            stack.enter_context(_without_torch_deprecations())
            stack.enter_context(safe_load.deepspeed_loading())
            load_dir = stack.enter_context(self._universal(path, saved.get("world_size"))) if reshard else path
            loaded, _ = self.engine.load_checkpoint(
                str(load_dir),
                tag=ckpt_state.DEEPSPEED_TAG,
                load_module_strict=strict,
                load_optimizer_states=wants_optimizer,
                load_lr_scheduler_states=wants_optimizer,
                load_module_only=not wants_optimizer,
            )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}")
        rest = {k: v for k, v in state.items() if k not in keys}
        out = ckpt_state.load_into(rest, meta, self.unwrap, ckpt_state.FULL, strict)
        state.update(rest)
        return out

    def _swaps_optimizer(self) -> bool:
        return bool(getattr(self.engine.optimizer, "swap_optimizer", False))

    def _swapped_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Under NVMe optimizer offload DeepSpeed (0.19) writes its fp32 master weights and optimizer state
        into its checkpoint as empty tensors: they live in the swap files under ``nvme_path`` (deepspeed#2082,
        #4416). Gathered whole here through DeepSpeed's own API (``safe_get_full_*``, which swaps them in), by
        parameter name; rank 0 keeps them, so the checkpoint's weights are there to read (``distrain convert``,
        ``verify``). Restoring them into a swapping optimizer needs DeepSpeed's internals (its load purges the
        swapped state), so such a resume is refused in ``load_checkpoint`` rather than run from other weights."""
        if not self._swaps_optimizer():
            return None
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        keys = _optimizer_state_keys(self.engine.optimizer.optimizer)
        out: dict[str, dict[str, torch.Tensor]] = {}
        gathered: dict[int, dict[str, torch.Tensor]] = {}  # a tied parameter once, under each of its names
        for name, param in self.engine.module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            if id(param) not in gathered:
                entry = {"fp32": safe_get_full_fp32_param(param)}
                entry.update({key: safe_get_full_optimizer_state(param, key) for key in keys})
                gathered[id(param)] = {k: v.detach().cpu().clone() for k, v in entry.items()}
            if self.is_global_zero:
                out[name] = gathered[id(param)]
        return out

    @contextlib.contextmanager
    def _universal(self, path: Path, saved_world_size: int | None):
        """Resume on another number of ranks: DeepSpeed's Universal Checkpoint. Rank 0 converts the
        engine's partitions (``ds_to_universal``) into a temporary directory beside the checkpoint
        (the checkpoint itself stays as written); every rank loads its new partitions from it."""
        import shutil

        tmp = path.with_name(f".{path.name}.universal")

        def convert() -> None:  # rank 0 alone; a failure reaches every rank at once (no barrier left waiting)
            shutil.rmtree(tmp, ignore_errors=True)
            print(
                f"distrain: {path.name} was written on {saved_world_size} ranks; converting it to DeepSpeed's "
                f"universal format to resume on {self.world_size}",
                flush=True,
            )
            try:
                with safe_load.deepspeed_loading():
                    compat.deepspeed_to_universal(
                        str(path / ckpt_state.DEEPSPEED_TAG), str(tmp / ckpt_state.DEEPSPEED_TAG)
                    )
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

        distributed.decided_on_rank_zero(convert)
        try:
            with compat.deepspeed_universal_loading(self.engine):
                yield tmp
        finally:
            self.barrier("universal checkpoint loaded")
            if self.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)

    def _load_foreign(self, path: Path, state: dict[str, Any], keys: list[str], strict: bool) -> dict[str, Any]:
        """Full weights (a DDP/FSDP checkpoint, or a ZeRO one consolidated) into the model; a
        DDP/FSDP optimizer state has another layout and cannot be resumed here."""
        if any(not isinstance(state[k], nn.Module) for k in keys):
            raise RuntimeError(
                f"{path} is not a DeepSpeed checkpoint: DeepSpeed can take its weights but not resume "
                "its optimizer state; load it as weights (e.g. validate/test with ckpt_path) instead"
            )
        weights = ckpt_state.read_model_weights(path)
        for k in keys:
            load_full_weights(self.unwrap(state[k]), weights, strict)
        return {}


def _check_nvme_offload(config: dict, source: str) -> None:
    """NVMe offload (ZeRO-Infinity) needs libaio for DeepSpeed's async_io op and a directory on the
    drive: refused here, before any rank starts, rather than in rank 0's first step."""
    zero = config.get("zero_optimization") or {}
    paths = sorted(
        {
            block.get("nvme_path") or "/local_nvme"
            for block in (zero.get("offload_param"), zero.get("offload_optimizer"))
            if isinstance(block, dict) and block.get("device") == "nvme"
        }
    )
    if not paths:
        return
    for path in paths:
        if not os.path.isdir(path) or not os.access(path, os.W_OK):
            raise ValueError(
                f"NVMe offload: nvme_path {path!r} (in {source}) is not a writable directory; point "
                "deepspeed.nvme_path (DeepSpeedStrategy(nvme_path=...)) at a directory on the NVMe drive"
            )
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")  # no guessing noise
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ValueError(
            "NVMe offload (ZeRO-Infinity) needs libaio for DeepSpeed's async_io op, and this machine "
            "lacks it: install it (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: dnf install "
            "libaio-devel), or offload to cpu"
        )


def _deepspeed_checkpointed(forward):
    """``forward`` under ``deepspeed.checkpointing.checkpoint``, which takes positional arguments only:
    keyword ones (an HF layer's attention mask, rotary embeddings) are bound into the recomputed call."""
    import deepspeed

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute (its buffers count backward passes)
            return forward(*args, **kwargs)
        function = functools.partial(forward, **kwargs) if kwargs else forward
        return deepspeed.checkpointing.checkpoint(function, *args)

    return checkpointed


class _NormAfterStep:
    """The global gradient norm the engine computes inside ``step()`` (over all partitions,
    before clipping), for the loop that asks for it just before the step and logs it after."""

    def __init__(self, engine):
        self.engine = engine

    def __float__(self) -> float:
        return float(self.engine.get_global_grad_norm())


def load_full_weights(module: nn.Module, weights: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Full weights into a (possibly ZeRO-3 partitioned) module: gathered, loaded by rank 0,
    re-partitioned."""
    import deepspeed

    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        # partitioned: rank 0's values are scattered on exit; otherwise each rank holds its own copy
        if not partitioned or not dist.is_initialized() or dist.get_rank() == 0:
            module.load_state_dict(weights, strict=strict)


@contextlib.contextmanager
def _recording_saves(checkpoint_engine):
    """The files this rank's engine writes (``checkpoint_engine.save(state_dict, path)``: deepspeed 0.19.8)."""
    written: list[Path] = []
    save = checkpoint_engine.save

    def recorded(state_dict, path, *args, **kwargs):
        written.append(Path(path))
        return save(state_dict, path, *args, **kwargs)

    checkpoint_engine.save = recorded
    try:
        yield written
    finally:
        del checkpoint_engine.save  # the class's own method again


def _optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """The per-element state an optimizer keeps (Adam: exp_avg, exp_avg_sq), not its step counts."""
    return sorted({k for state in optimizer.state.values() for k, v in state.items() if torch.is_tensor(v) and v.dim()})


def _write_full_weights(checkpoint_dir: Path) -> list[Path]:
    """``save_full_weights``: one consolidated fp32 file beside the shards, for use elsewhere."""
    from safetensors.torch import save_file

    weights = ckpt_state.read_model_weights(checkpoint_dir)
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(checkpoint_dir / "model.safetensors"))
    return [checkpoint_dir / "model.safetensors"]


class _GatheredPartitions(sharded_init.ShardAccess):
    """ZeRO-3: a partitioned parameter is gathered whole (``GatheredParameters``) while
    initialization works on it, and partitioned again (from rank 0's identical copy) after."""

    metadata_from_shard = False  # a partitioned parameter's own shape is empty

    def __init__(self):
        self._open: dict[int, Any] = {}

    def full(self, param, overwritten):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0)
        gathered.__enter__()
        self._open[id(param)] = gathered
        return param

    def commit(self, param, full):
        self._open.pop(id(param)).__exit__(None, None, None)


def _prefix_of(model: nn.Module | None, root: nn.Module) -> str:
    """Where the user's module sits inside the engine's (e.g. ``module.`` under the Trainer)."""
    for name, m in root.named_modules():
        if m is model:
            return f"{name}." if name else ""
    return ""


def _values_from_hyperparameters(module: nn.Module) -> dict[str, Any]:
    """ "auto" values a module states in its hyperparameters (the built-in and HF jobs do)."""
    for m in module.modules():
        hparams = getattr(m, "hparams", None)
        if isinstance(hparams, dict) and "warmup_steps" in hparams:
            return {"warmup_num_steps": max(1, int(hparams["warmup_steps"]))}  # DeepSpeed wants >= 1
    return {}


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The client optimizer's settings, for "auto" in the config's optimizer section. The lr is
    the base one: a scheduler built on the optimizer has already scaled ``group["lr"]``."""
    group = optimizer.param_groups[0]
    out = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
    out["lr"] = group.get("initial_lr", group["lr"])
    return out


@contextlib.contextmanager
def _without_torch_deprecations():
    with warnings.catch_warnings():
        _ignore_torch_deprecations()
        yield


def _ignore_torch_deprecations() -> None:
    # ZeRO calls torch's renamed collectives hundreds of times per run; one warning each
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning, message=r".*TypedStorage is deprecated.*")


def _quiet_deepspeed(level: int, accelerator: str) -> None:
    # name the accelerator so DeepSpeed does not guess (and warn about guessing) at import
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if accelerator == "cuda" else "cpu")
    from deepspeed.utils import logger

    logger.setLevel(level)
    _ignore_torch_deprecations()


def options_from_config(config, block_classes) -> dict:
    """The config's ``deepspeed:`` section → DeepSpeedStrategy options (a preset fixes stage and
    offload itself; only the plain ``deepspeed`` name takes them from the section)."""
    ds = config.deepspeed
    options = dict(
        config=ds.config,
        nvme_path=ds.nvme_path,
        partition_activations=ds.partition_activations,
        cpu_checkpointing=ds.cpu_checkpointing,
        save_full_weights=ds.save_full_weights,
    )
    if config.distributed.strategy == "deepspeed":
        options.update(
            stage=ds.stage,
            offload_optimizer=ds.offload_optimizer,
            offload_parameters=ds.offload_parameters,
            offload_optimizer_device=ds.offload_optimizer_device,
            offload_params_device=ds.offload_params_device,
        )
    return options


def check(config) -> None:
    """The ``deepspeed:`` section of a config, and what a DeepSpeed run cannot do."""
    from distrain.strategies.registry import section_of

    ds, t, strategy = config.deepspeed, config.training, config.distributed.strategy
    for name in ("offload_optimizer_device", "offload_params_device"):
        if getattr(ds, name) not in ("cpu", "nvme"):
            raise ConfigError(f"deepspeed.{name} must be cpu or nvme, got {getattr(ds, name)!r}")
    deepspeed_run = section_of(strategy) == "deepspeed"
    if ds.config is not None and not deepspeed_run:
        raise ConfigError(
            f"deepspeed.config is set ({ds.config}) but distributed.strategy is {strategy!r}; "
            "use strategy deepspeed (or a deepspeed_stage_* preset), or drop the DeepSpeed config"
        )
    checks = (
        ("training.compile", t.compile),
        ("training.precision=fp8", t.precision == "fp8"),
        ("checkpointing.async_save", config.checkpointing.async_save),
    )
    for key, on in checks:
        if deepspeed_run and on:
            raise ConfigError(f"{key} is not supported with distributed.strategy {strategy!r} (DeepSpeed)")


for _name, _preset_options in PRESETS.items():
    register(
        _name,
        functools.partial(DeepSpeedStrategy, **_preset_options),  # a run's own keywords override
        f"DeepSpeed ZeRO {_preset_options}",
        options_from_config,
        "deepspeed",
        check,
        cost_model="distrain.planner.models.zero",
    )
