"""The training loop's parts that trainer.py composes: checkpointing, evaluation, metrics, monitoring,
preemption, the non-finite policy, the default callbacks and loggers, and the forms of ``configure_optimizers``."""
