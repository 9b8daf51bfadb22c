"""``lightning.fabric``: the names a Lightning script takes from it beside the Trainer (``seed_everything``; the
cluster environments under ``lightning.fabric.plugins.environments``, the seed and rank-zero helpers under
``lightning.fabric.utilities``). Fabric itself is refused: distrain's loop is the Trainer's."""

from distrain.lightning._refuse import refusing
from distrain.lightning.trainer import seed_everything

__all__ = ["seed_everything"]

__getattr__ = refusing(__name__, "distrain runs the Trainer's loop: write the step as a LightningModule")
