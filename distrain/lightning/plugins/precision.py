"""``lightning.pytorch.plugins.precision``: a precision is ``Trainer(precision=...)`` here (32-true, 16-mixed,
bf16-mixed, bf16-true, 64-true, fp8), so a precision plugin is refused where it is imported, saying so."""

from distrain.lightning._refuse import refusing

__getattr__ = refusing(
    __name__, "a precision is Trainer(precision=...): 32-true, 16-mixed, bf16-mixed, bf16-true, 64-true, fp8"
)
