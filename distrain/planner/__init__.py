"""The memory planner: every strategy's per-rank memory, predicted without allocating the model.

    from distrain.planner import Budget, Job, ModelSpec, Planner

    job = Job(ModelSpec.builtin_gpt("gpt-7b", 2048), micro_batch=1, precision="bf16-mixed", world_size=8, gpu=True)
    plan = Planner(job, Budget.resolve(8, gpu=True, gpu_memory="80GB")).plan()
    print(plan.table())

Layout: ``model_stats`` (the model on the meta device, its parameters, the traced step under fake
tensors), ``simulate`` (FSDP2 on a fake process group), ``estimate`` (the options and each one's
parts; DDP), ``zero`` (DeepSpeed ZeRO), ``plan`` (budget, ranking, table, recommendation),
``cli`` (``distrain plan`` and the decisions ``distrain train`` takes), ``auto``
(``Trainer(strategy="auto")``), ``measure`` (measured peaks, for the accuracy test and benchmark).
"""

from distrain.planner.estimate import Estimator, Job, Option, Row
from distrain.planner.model_stats import ModelSpec
from distrain.planner.plan import Budget, Plan, Planner

__all__ = ["Budget", "Estimator", "Job", "ModelSpec", "Option", "Plan", "Planner", "Row"]
