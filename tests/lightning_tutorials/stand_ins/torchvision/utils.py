"""``make_grid``: a batch of images side by side, in rows of ``nrow``, with torchvision's default padding."""

from __future__ import annotations

import torch


def make_grid(tensor: torch.Tensor, nrow: int = 8, padding: int = 2, pad_value: float = 0.0, **kwargs) -> torch.Tensor:
    if tensor.dim() == 3:
        tensor = tensor.unsqueeze(0)
    if tensor.size(1) == 1:
        tensor = tensor.expand(-1, 3, -1, -1)
    n, channels, height, width = tensor.shape
    columns = min(nrow, n)
    rows = -(-n // columns)
    h, w = height + padding, width + padding
    grid = tensor.new_full((channels, rows * h + padding, columns * w + padding), pad_value)
    for k in range(n):
        y, x = divmod(k, columns)
        grid[:, y * h + padding : (y + 1) * h, x * w + padding : (x + 1) * w] = tensor[k]
    return grid
