"""The cost model of ``fsdp`` and ``fsdp_cpu_offload``: FSDP2 itself, simulated on a fake process group
(``simulate.py``, measured by ``FSDPMemTracker``), and its gathers and reductions per step."""

from __future__ import annotations

from distrain.planner.models import CostModel, model_of
from distrain.planner.models.replicated import (
    offered_expert_parallel,
    replicated,
    tokens_to_experts,
    with_worst_routing,
)
from distrain.planner.options import Option, Row
from distrain.planner.timing import Collective, step_time

LEVELS = {"SHARD_GRAD_OP": 2, "HYBRID_SHARD": 3, "FULL_SHARD": 4}


class FSDP(CostModel):
    kinds = ("fsdp",)
    sharded_dtypes = True
    defaults = {"sharding_strategy": "FULL_SHARD"}

    def offered(self, job) -> list[Option]:
        if job.world_size == 1:
            return []
        options = [Option("fsdp", sharding="SHARD_GRAD_OP"), Option("fsdp", sharding="FULL_SHARD")]
        if job.num_nodes > 1 and job.world_size > job.num_nodes:
            options.append(Option("fsdp", sharding="HYBRID_SHARD"))
        if job.accumulate > 1:  # gradients reduce-scattered after every micro-batch: no unsharded ones kept between
            options.append(Option("fsdp", sharding="FULL_SHARD", sync_each=True))
        if job.gpu:
            options.append(Option("fsdp", sharding="FULL_SHARD", offload="cpu"))
        options += [
            Option("fsdp", sharding="FULL_SHARD", experts=o.get("experts")) for o in offered_expert_parallel(job)
        ]
        return options

    def from_config(self, config) -> dict:
        """The ``fsdp:`` section: what a run shards and offloads, and the options its simulation takes."""
        f = config.fsdp
        return {
            "sharding": f.sharding_strategy,
            "cpu_offload": f.cpu_offload,
            "options": {
                "forward_prefetch": f.forward_prefetch,
                "sync_each_micro_batch": f.sync_each_micro_batch,
                "mixed_precision": {k: v for k, v in vars(f.mixed_precision).items() if v} or None,
            },
        }

    def option_for_run(self, strategy: str, job) -> Option:
        """The config's sharding and offload (``fsdp_cpu_offload`` offloads whatever it says; offload needs a GPU)."""
        configured = self.configured(job)
        asked = configured.get("cpu_offload", False) or strategy == "fsdp_cpu_offload"
        offload = "cpu" if asked and job.gpu else "none"
        sharding = configured.get("sharding", "FULL_SHARD")
        if sharding == "NO_SHARD" and offload == "none":  # replicated on every rank: DDP's memory
            return replicated(job)
        experts = job.expert_parallel if job.expert_parallel > 1 else None
        sharding = "FULL_SHARD" if sharding == "NO_SHARD" else sharding
        sync_each = configured.get("options", {}).get("sync_each_micro_batch") and job.accumulate > 1 or None
        return Option("fsdp", sharding=sharding, offload=offload, experts=experts, sync_each=sync_each)

    def strategy(self, option) -> str:
        return "fsdp_cpu_offload" if option.offload == "cpu" else "fsdp"

    def settings(self, option) -> dict:
        experts = {"expert_parallel_size": option.get("experts")} if option.get("experts") else {}
        sync_each = {"sync_each_micro_batch": True} if option.get("sync_each") else {}
        return {"sharding_strategy": option.get("sharding"), **experts, **sync_each}

    def level(self, option) -> int:
        return LEVELS[option.get("sharding")]

    def label(self, option, accumulate=None) -> str:
        experts = option.get("experts")
        label = f"fsdp {option.get('sharding')}" + (f" + experts over {experts}" if experts else "")
        return label + (" + reduce each micro-batch" if option.get("sync_each") else "")

    def short(self, option) -> str:
        short = "FSDP" + {"SHARD_GRAD_OP": " grad-op", "HYBRID_SHARD": " hybrid"}.get(option.get("sharding"), "")
        short += f"+EP{option.get('experts')}" if option.get("experts") else ""
        return short + ("+sync" if option.get("sync_each") else "")

    def offloaded(self, option) -> str:
        return "params+grads+opt"

    def prefetch(self, estimator, option) -> None:
        from distrain.planner.simulate import start_fsdp_simulation

        estimator.start(_key(estimator, option), lambda: start_fsdp_simulation(**_simulation(estimator, option)))

    def estimate(self, estimator, option) -> Row:
        from distrain.planner.simulate import start_fsdp_simulation

        p = estimator.memo(_key(estimator, option), lambda: start_fsdp_simulation(**_simulation(estimator, option)))
        # the activations column means the same for every row: the traced peak at this micro-batch (the
        # simulation's own kinds at its peak moment mix in the optimizer step's temporaries)
        activations = estimator.trace("fsdp", option.checkpoint).activations
        if option.offload == "none":
            row = Row(option, p.params, p.grads, p.optimizer, activations, p.buffers, p.peak, sharded=p.sharded_state)
            return with_worst_routing(estimator, option, row)
        # CPU offload keeps the sharded parameters, gradients and optimizer state in host memory (the
        # optimizer steps there); the device holds what is unsharded for compute
        row = Row(
            option,
            p.params,
            p.grads,
            p.optimizer,
            activations,
            p.buffers,
            p.peak - p.sharded_state,
            host=p.sharded_state,
            note="device peak: the simulated one less the sharded state moved to the host",
        )
        return with_worst_routing(estimator, option, row)

    def time_of(self, option, job, trace, units: int, hw):
        """The step of ``trace`` (the bare step in FSDP's dtypes) with ``units`` gather units."""
        sent = self.collectives(option, job, trace, units)
        gathers = job.accumulate * _gathers(option)  # offloaded parameters are copied in at each gather
        offload = option.offload != "none"
        return step_time(job, trace, sent, hw, 1 / job.world_size, offload, gathers)

    def collectives(self, option, job, trace, units: int) -> list[Collective]:
        """Each unit's parameters gathered (in the compute dtype, float8 linear weights in float8) in forward, and
        again in backward when resharded; gradients reduce-scattered in fp32 (``FSDPStrategy``'s policy); hybrid:
        within a node, then across."""
        n, a = job.world_size, job.accumulate
        if n == 1:
            return []
        params, reduce, inter = trace.param_bytes, trace.elements * 4, job.num_nodes > 1
        params -= trace.float8_bytes - trace.float8_elements
        gathers = _gathers(option)
        # reduced once per step, or after every micro-batch (``fsdp.sync_each_micro_batch``)
        reductions = a if option.get("sync_each") else 1
        if option.get("sharding") == "HYBRID_SHARD" and job.num_nodes > 1:
            per_node = job.per_node
            return [
                Collective("all_gather", params, per_node, gathers * a, units, copied=True),
                Collective("reduce_scatter", reduce, per_node, reductions, units, copied=True),
                Collective("all_reduce", reduce / per_node, job.num_nodes, reductions, units, True),
            ]
        experts = option.get("experts")
        if experts:  # each layer's experts a unit of their own, 1/N of them, over the n/N ranks that hold them
            share = trace.expert_bytes / trace.param_bytes
            holders, layers = n // experts, trace.moe_layers
            return [
                Collective("all_gather", params * (1 - share), n, gathers * a, units, inter, True),
                Collective("reduce_scatter", reduce * (1 - share), n, reductions, units, inter, True),
                Collective("all_gather", params * share / experts, holders, gathers * a, layers, inter, True),
                Collective("reduce_scatter", reduce * share / experts, holders, reductions, layers, inter, True),
                tokens_to_experts(job, trace, experts),
            ]
        return [
            Collective("all_gather", params, n, gathers * a, units, inter, True),
            Collective("reduce_scatter", reduce, n, reductions, units, inter, True),
        ]


def _key(estimator, option) -> tuple:
    return ("fsdp", option.get("sharding"), option.checkpoint, estimator.job.micro_batch, bool(option.get("sync_each")))


def _simulation(estimator, option) -> dict:
    """The arguments of the option's simulation (``simulate.start_fsdp_simulation``)."""
    job = estimator.job
    return dict(
        spec=job.spec,
        micro_batch=job.micro_batch,
        world_size=job.world_size,
        num_nodes=job.num_nodes,
        sharding=option.get("sharding"),
        precision=job.precision,
        checkpoint=option.checkpoint,
        accumulate=job.accumulate,
        foreach=job.gpu,
        # the option's reduction, whatever the config says (auto may choose either)
        options={
            **model_of("fsdp").configured(job).get("options", {}),
            "sync_each_micro_batch": bool(option.get("sync_each")),
        },
    )


def _gathers(option) -> int:
    """Gathers per micro-batch: forward, and again in backward when resharded."""
    return 1 if option.get("sharding") == "SHARD_GRAD_OP" else 2


MODELS = (FSDP(),)
