"""``lightning.pytorch.plugins``: Lightning's plugins are arguments and launchers here, so each of its names is
refused where it is imported, saying what does its work (``Trainer(plugins=...)`` itself is refused alike)."""

from distrain.lightning._refuse import refusing

__getattr__ = refusing(
    __name__, "a precision is Trainer(precision=...), and the cluster's variables are read by the launcher"
)
