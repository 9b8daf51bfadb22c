"""Precision plugins: what autocast to enter, how to convert the module, whether to scale."""

from __future__ import annotations

import contextlib

import torch


class Precision:
    """``32-true`` | ``16-mixed`` | ``bf16-mixed`` | ``bf16-true``."""

    def __init__(self, name: str, device_type: str):
        if name not in ("32-true", "16-mixed", "bf16-mixed", "bf16-true"):
            raise ValueError(f"precision must be 32-true, 16-mixed, bf16-mixed or bf16-true, got {name!r}")
        if name == "16-mixed" and device_type != "cuda":
            raise ValueError("precision='16-mixed' needs a CUDA GPU (fp16 with a GradScaler); on CPU use 'bf16-mixed'")
        self.name = name
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler("cuda") if name == "16-mixed" else None

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}.get(
            self.name, torch.float32
        )

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def autocast(self):
        if self.name in ("16-mixed", "bf16-mixed"):
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping, gradients must be in true units."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)  # skips the step when grads overflowed
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
