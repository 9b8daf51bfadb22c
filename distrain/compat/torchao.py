"""torchao's (``precision="fp8"``): the import noise of its optional kernels. Each names what it relies on and the
versions it was checked against; ``tests/test_compat.py`` exercises each for real (``distrain/compat/__init__.py``)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("distrain")


# ---- torchao (precision="fp8") ------------------------------------------------------------------------------
class DropImportNoise(logging.Filter):
    """torchao 0.18 on a CPU build of torch: importing it (transformers does, for any model) warns that its
    CUDA kernels cannot load and makes torch warn about its enum registrations. Neither says anything a
    user can act on; only these two messages are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cpu_kernels = message.startswith("Failed to load") and ".so" in message and not torch.cuda.is_available()
        return not (cpu_kernels or "is an Enum subclass and is now natively supported by torch.compile" in message)
