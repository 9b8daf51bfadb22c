"""The planner: every layout's per-rank memory and step time, predicted without allocating the model.

    from distrain.planner import Budget, Job, ModelSpec, Planner

    job = Job(ModelSpec.builtin_gpt("gpt-7b", 2048), micro_batch=1, precision="bf16-mixed", world_size=8, gpu=True)
    plan = Planner(job, Budget.resolve(8, gpu=True, gpu_memory="80GB")).plan()
    print(plan.table())

Layout: ``model_stats`` (the model on the meta device, its parameters, the traced step under fake
tensors), ``work`` (its FLOPs and bytes), ``simulate`` (FSDP2 and tensor parallelism on a fake process
group), ``options`` (what an option and a row are), ``estimate`` (the job, and what every option's estimate
shares: traces, depth, partial checkpointing), ``models/`` (each strategy's cost model: ``replicated``,
``fsdp``, ``zero``, ``tensor``, ``pipeline``), ``timing`` (seconds per step from work and collectives), ``plan``
(budget, ranking, table, recommendation), ``machine`` (this machine's rates, measured once and kept),
``decide`` (the one ``auto`` decision, for ``distrain train`` and ``Trainer(strategy="auto")`` alike),
``from_config`` (the job a run's config plans), ``cli`` (``distrain plan``), ``oom`` (what a rank that ran out
of memory is told).
Measured peaks, for the accuracy tests and benchmark: ``benchmarks/plan_measure.py``.
"""

from distrain.planner.estimate import Estimator, Job, Option, Row
from distrain.planner.model_stats import ModelSpec
from distrain.planner.plan import Budget, Plan, Planner

__all__ = ["Budget", "Estimator", "Job", "ModelSpec", "Option", "Plan", "Planner", "Row"]
