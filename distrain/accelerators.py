"""CPU or CUDA: which device a rank uses, its process-group backend, memory and peak FLOP/s."""

from __future__ import annotations

import os
import resource
import sys

import torch

# Dense bf16/fp16 tensor-core peak (FLOP/s) by device-name fragment, for MFU. Unknown → no MFU.
_CUDA_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
}


class Accelerator:
    name = "cpu"
    backend = "gloo"

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def setup_device(self, device: torch.device) -> None:
        pass

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        # ru_maxrss is the process's peak resident set (KiB on Linux, bytes on macOS).
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = peak / 2**20 if sys.platform == "darwin" else peak / 1024
        return {"mem_peak_rss_mb": round(peak_mb, 1)}

    def peak_flops(self, device: torch.device, dtype: torch.dtype) -> float | None:
        return None

    def synchronize(self, device: torch.device) -> None:
        pass


class CUDAAccelerator(Accelerator):
    name = "cuda"
    backend = "nccl"

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))

    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        return {
            "mem_allocated_mb": round(torch.cuda.memory_allocated(device) / 2**20, 1),
            "mem_max_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
            "mem_reserved_mb": round(torch.cuda.memory_reserved(device) / 2**20, 1),
        }

    def peak_flops(self, device: torch.device, dtype: torch.dtype) -> float | None:
        name = torch.cuda.get_device_name(device)
        for fragment, flops in _CUDA_PEAK_FLOPS.items():
            if fragment in name:
                # fp32 without TF32 runs far below the tensor-core peak; MFU would mislead.
                return flops if dtype in (torch.bfloat16, torch.float16) else None
        return None

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


def resolve_accelerator(name: str = "auto") -> Accelerator:
    if name in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"accelerator={name!r} was requested but no CUDA GPU is available on this machine")
        return CUDAAccelerator()
    if name == "cpu":
        return Accelerator()
    if name == "auto":
        return CUDAAccelerator() if torch.cuda.is_available() else Accelerator()
    raise ValueError(f"accelerator must be 'auto', 'cpu' or 'gpu', got {name!r}")


def auto_device_count(accelerator: Accelerator) -> int:
    """devices='auto': every GPU, or on CPU one rank per 1 core... capped so threads are not starved."""
    if accelerator.name == "cuda":
        return torch.cuda.device_count()
    return max(1, min(2, os.cpu_count() or 1))
