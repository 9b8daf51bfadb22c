"""The transforms Lightning's tutorials compose, on the stand-in's uint8 image tensors (``H×W`` or ``H×W×C``), with
torchvision's arithmetic and its draws from torch's generator (``RandomCrop``, ``RandomHorizontalFlip``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """A uint8 ``H×W`` or ``H×W×C`` image as a float ``C×H×W`` tensor in [0, 1]."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dim() == 2:
            image = image.unsqueeze(-1)
        return image.permute(2, 0, 1).contiguous().to(torch.float32).div(255)


class Normalize:
    def __init__(self, mean, std, inplace: bool = False):
        self.mean, self.std = torch.as_tensor(mean), torch.as_tensor(std)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)


def _channels_first(image: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Crops and flips work on ``…×H×W``; a stand-in image (``H×W×C``) is turned so and back."""
    if image.dtype == torch.uint8 and image.dim() == 3:
        return image.permute(2, 0, 1), True
    return image, False


class RandomCrop:
    def __init__(self, size, padding=None):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.padding = padding or 0

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image, turned = _channels_first(image)
        if self.padding:
            image = F.pad(image, [self.padding] * 4)
        height, width = image.shape[-2:]
        th, tw = self.size
        i = int(torch.randint(0, height - th + 1, size=(1,)).item())
        j = int(torch.randint(0, width - tw + 1, size=(1,)).item())
        image = image[..., i : i + th, j : j + tw]
        return image.permute(1, 2, 0) if turned else image


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if torch.rand(1) < self.p:
            image, turned = _channels_first(image)
            image = image.flip(-1)
            return image.permute(1, 2, 0) if turned else image
        return image
