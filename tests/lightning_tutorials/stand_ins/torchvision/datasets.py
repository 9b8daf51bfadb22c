"""MNIST and CIFAR-10 of synthetic images: each sample made from its own index when read (nothing is downloaded,
nothing held), in the real set's length, image shape and dtype (uint8, as torchvision's images before ``ToTensor``),
with a label drawn alongside. Reading a sample draws nothing from torch's global generator."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class _Synthetic(Dataset):
    shape: tuple[int, ...] = ()
    sizes = {True: 0, False: 0}  # train, test
    classes: list[str] = []

    def __init__(self, root=".", train: bool = True, transform=None, target_transform=None, download: bool = False):
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        self.salt = sum(map(ord, type(self).__name__)) * 2 + int(train)

    def __len__(self) -> int:
        return self.sizes[self.train]

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.salt * 1_000_003 + index)
        image = torch.randint(0, 256, self.shape, generator=g, dtype=torch.uint8)
        target = int(torch.randint(0, len(self.classes), (), generator=g))
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class MNIST(_Synthetic):
    shape = (28, 28)
    sizes = {True: 60_000, False: 10_000}
    classes = [f"{d} - {name}" for d, name in enumerate("zero one two three four five six seven eight nine".split())]


class CIFAR10(_Synthetic):
    shape = (32, 32, 3)  # height, width, channels: torchvision's CIFAR-10 images before ToTensor
    sizes = {True: 50_000, False: 10_000}
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
