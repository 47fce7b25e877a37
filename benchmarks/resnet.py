"""ResNet-18 and ResNet-50 (He et al. 2015, torchvision's layout), randomly initialized: the GPU check's models.

Written here because torchvision's PyPI build does not load against the
CPU torch pinned for this project. The layers, and so the parameter counts
(11,689,512 and 25,557,032 with 1000 classes), are torchvision's
``resnet18`` and ``resnet50`` (v1.5: the stride of a Bottleneck on its 3x3
convolution); nothing is downloaded.
"""

from torch import nn

LAYERS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}


class _Residual(nn.Module):
    """``relu(body(x) + shortcut(x))``; subclasses build ``body`` and ``shortcut``."""

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class BasicBlock(_Residual):
    """Two 3x3 convolutions (the first with the stride) and a shortcut; ``expansion`` 1."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.body = nn.Sequential(
            _conv(inplanes, planes, 3, stride), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            _conv(planes, planes, 3), nn.BatchNorm2d(planes))
        self.shortcut = _shortcut(inplanes, planes, stride)
        self.relu = nn.ReLU(inplace=True)


class Bottleneck(_Residual):
    """1x1 down to ``planes``, 3x3 (with the stride), 1x1 up to ``4 * planes``, and a shortcut."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        out = planes * self.expansion
        self.body = nn.Sequential(
            _conv(inplanes, planes, 1), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            _conv(planes, planes, 3, stride), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            _conv(planes, out, 1), nn.BatchNorm2d(out))
        self.shortcut = _shortcut(inplanes, out, stride)
        self.relu = nn.ReLU(inplace=True)


class ResNet(nn.Module):
    """A ResNet: 7x7 stem, four stages of ``blocks`` (64, 128, 256, 512 planes), average pool, linear.

    Args:
        block: BasicBlock or Bottleneck.
        blocks: blocks per stage, e.g. (2, 2, 2, 2).
        num_classes: outputs of the last layer.
    """

    def __init__(self, block, blocks, num_classes=1000):
        super().__init__()
        layers = [_conv(3, 64, 7, 2), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        inplanes = 64
        for stage, count in enumerate(blocks):
            planes = 64 * 2**stage
            for index in range(count):
                layers.append(block(inplanes, planes, 2 if stage and not index else 1))
                inplanes = planes * block.expansion
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(inplanes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images):
        """Return logits float ``[B, num_classes]`` of images ``[B, 3, H, W]``."""
        return self.fc(self.features(images))


def make_resnet(name, num_classes=1000):
    """Return a randomly initialized "resnet18" or "resnet50"."""
    kind, blocks = LAYERS[name]
    return ResNet(BasicBlock if kind == "basic" else Bottleneck, blocks, num_classes)


def _conv(inplanes, planes, kernel, stride=1):
    return nn.Conv2d(inplanes, planes, kernel, stride, kernel // 2, bias=False)


def _shortcut(inplanes, planes, stride):
    """Identity where the shape stays, else a strided 1x1 convolution and batch norm (torchvision's downsample)."""
    if stride == 1 and inplanes == planes:
        return nn.Identity()
    return nn.Sequential(_conv(inplanes, planes, 1, stride), nn.BatchNorm2d(planes))
