"""A stand-in for the parts of torchvision Lightning's tutorials use (PyPI's torchvision does not load beside this
project's CPU torch, and its data sets download): ``datasets`` of synthetic images in the real ones' shapes and
sizes, the ``transforms`` the tutorials compose, ``utils.make_grid`` and ``models.resnet18``. The same stand-in runs
under Lightning (the stored references) and under distrain. ``tests/lightning_tutorials/README.md`` says what each
part changes."""

from torchvision import datasets, models, ops, transforms, utils

__all__ = ["datasets", "models", "ops", "transforms", "utils"]
