"""What ``distrain train`` runs: a workload — the built-in GPT on a byte corpus (``gpt.py``), a Hugging Face model on
its dataset (``hf.py``), or a ``distrain.Module`` of your own that brings its data (``user.py``) — on the Trainer
the config describes. ``run`` is the whole command: the job, the memory plan's decisions, the Trainer, fit.

Every workload is built before any rank starts (a wrong name fails at once, reading only what that needs) and has
``block_classes`` (the model's repeated layer: FSDP units, activation checkpointing), ``plannable`` (the CLI's
memory plan models it; a Module of your own is planned by ``Trainer.fit`` from the module itself) and
``fit(trainer, resume)`` (its data and module, then ``trainer.fit``)."""

from distrain.jobs.common import Workload
from distrain.jobs.run import job_for, run

__all__ = ["Workload", "job_for", "run"]
