"""The training loop's parts that trainer.py composes: checkpointing, evaluation, metrics, monitoring,
preemption."""
