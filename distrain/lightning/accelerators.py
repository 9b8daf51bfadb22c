"""``lightning.pytorch.accelerators``: ``find_usable_cuda_devices``, as Lightning's documentation uses it
(``Trainer(devices=find_usable_cuda_devices(2))``); its accelerator classes are names here
(``Trainer(accelerator="cuda")``)."""

from __future__ import annotations

from distrain.lightning._refuse import refusing

__all__ = ["find_usable_cuda_devices"]


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """Lightning's: the indices of ``num_devices`` CUDA GPUs that take work (-1: every one that does), each tried
    with a small allocation, so that a GPU in exclusive mode that another process holds is passed over. Fewer than
    asked is an error saying how many there are."""
    import torch

    if num_devices == 0:
        return []
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ValueError(f"find_usable_cuda_devices({num_devices}): this machine has no visible CUDA GPU")
    if num_devices > visible:
        raise ValueError(f"find_usable_cuda_devices({num_devices}): this machine has {visible} visible CUDA GPUs")
    usable = []
    for index in range(visible):
        if num_devices != -1 and len(usable) == num_devices:
            break
        try:
            torch.tensor(0, device=torch.device("cuda", index))
        except RuntimeError:  # busy (exclusive mode) or broken: not usable
            continue
        usable.append(index)
    if num_devices != -1 and len(usable) < num_devices:
        raise RuntimeError(
            f"find_usable_cuda_devices({num_devices}): only {len(usable)} of the {visible} visible CUDA GPUs take "
            f"work (the others are busy in exclusive mode or unavailable): {usable}"
        )
    return usable


__getattr__ = refusing(__name__, 'an accelerator is Trainer(accelerator="cpu" / "cuda" / "auto")')
