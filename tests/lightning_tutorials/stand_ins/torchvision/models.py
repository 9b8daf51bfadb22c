"""``resnet18``: the ResNet-18 architecture (basic blocks of two 3×3 convolutions, [2, 2, 2, 2] of them), with the
attribute names the tutorials replace (``conv1``, ``maxpool``, ``fc``); never pretrained (nothing downloads)."""

from __future__ import annotations

from torch import nn


class _Block(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, inputs = (64, 128, 256, 512), 64
        for index, width in enumerate(widths, start=1):
            stride = 1 if index == 1 else 2
            setattr(self, f"layer{index}", nn.Sequential(_Block(inputs, width, stride), _Block(width, width, 1)))
            inputs = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(pretrained: bool = False, weights=None, num_classes: int = 1000, **kwargs) -> ResNet:
    if pretrained or weights is not None:
        raise RuntimeError("the torchvision stand-in has no pretrained weights (nothing downloads here)")
    return ResNet(num_classes)


def _not_here(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"torchvision.models.{name} is not in the torchvision stand-in (tests/lightning_tutorials)")

    refuse.__name__ = name
    return refuse


# imported by torchmetrics at its own import when it finds a torchvision; no tutorial here calls them
resnet50, vgg16, VGG16_Weights = _not_here("resnet50"), _not_here("vgg16"), _not_here("VGG16_Weights")
