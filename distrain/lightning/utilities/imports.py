"""``lightning.pytorch.utilities.imports``: whether an optional package is installed, as Lightning's examples ask."""

from importlib.util import find_spec

_TORCHVISION_AVAILABLE = find_spec("torchvision") is not None
_RICH_AVAILABLE = find_spec("rich") is not None
_TQDM_AVAILABLE = find_spec("tqdm") is not None
