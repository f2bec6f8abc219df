"""ResNet image classifiers (ResNet-18/34/50/101/152, v1.5) with torchvision's tensor names.

Shapes: B batch, C channels, H x W image size, K classes. The parameter and buffer names match
torchvision's ``resnet*`` models, so their state dicts load by name with
:func:`load_state_dict_by_name`. ``small_input=True`` is the CIFAR stem for 32x32 images (a 3x3
stride-1 ``conv1`` and no max-pool): every torchvision tensor then loads except ``conv1.weight``,
whose shape differs (pass ``skip=["conv1.weight"]`` to keep the model's own).

Residual adds are out of place and ReLUs are not in-place, so the tracer records plain ops. At
layer granularity each residual block is one node (op kind ``module:fusionllm.models.resnet.
BasicBlock`` / ``...Bottleneck``, rebuilt on a worker from its config); at ``fine`` granularity the
convolutions, batch norms, ReLUs and adds inside a block become nodes of their own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import ClassVar

import torch
from torch import nn

from fusionllm.core.errors import ConfigError, RegistryError

# name -> (block kind, blocks per stage)
VISION_MODELS: dict[str, tuple[str, list[int]]] = {
    "resnet18": ("basic", [2, 2, 2, 2]),
    "resnet34": ("basic", [3, 4, 6, 3]),
    "resnet50": ("bottleneck", [3, 4, 6, 3]),
    "resnet101": ("bottleneck", [3, 4, 23, 3]),
    "resnet152": ("bottleneck", [3, 8, 36, 3]),
}
_STAGE_WIDTHS = (64, 128, 256, 512)
_MAX_LISTED = 5


def _conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    """A bias-free convolution that keeps H x W at stride 1 (padding kernel_size // 2)."""
    return nn.Conv2d(
        in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False
    )


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """The projection shortcut (1x1 conv + BN, torchvision's ``downsample``), or None for identity."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(_conv(in_channels, out_channels, 1, stride), nn.BatchNorm2d(out_channels))


class _Block(nn.Module):
    """What both residual blocks share: their op config and the shortcut branch."""

    expansion: ClassVar[int] = 1
    downsample: nn.Sequential | None

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        if min(in_channels, planes, stride) < 1:
            raise ConfigError(
                f"{type(self).__name__}: in_channels, planes and stride must be >= 1, "
                f"got {in_channels}, {planes}, {stride}"
            )
        self.in_channels, self.planes, self.stride = in_channels, planes, stride

    def fusionllm_config(self) -> dict:
        """The op config of this block in an OpGraph (op kind ``module:...resnet.<Block>``)."""
        return {"in_channels": self.in_channels, "planes": self.planes, "stride": self.stride}

    @classmethod
    def from_fusionllm_config(cls, config: dict) -> _Block:
        return cls(int(config["in_channels"]), int(config["planes"]), int(config.get("stride", 1)))

    def _identity(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.downsample is None else self.downsample(x)  # (B, C_out, H', W')


class BasicBlock(_Block):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34); stride on the first."""

    expansion: ClassVar[int] = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__(in_channels, planes, stride)
        self.conv1 = _conv(in_channels, planes, 3, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = _conv(planes, planes, 3)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(in_channels, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))  # (B, planes, H', W')
        out = self.bn2(self.conv2(out))  # (B, planes, H', W')
        out = out + self._identity(x)  # (B, planes, H', W')
        return self.relu(out)


class Bottleneck(_Block):
    """1x1 reduce, 3x3 (carries the stride: ResNet v1.5), 1x1 expand by 4, residual connection."""

    expansion: ClassVar[int] = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__(in_channels, planes, stride)
        out_channels = planes * self.expansion
        self.conv1 = _conv(in_channels, planes, 1)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv(planes, planes, 3, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv(planes, out_channels, 1)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=False)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))  # (B, planes, H, W)
        out = self.relu(self.bn2(self.conv2(out)))  # (B, planes, H', W')
        out = self.bn3(self.conv3(out))  # (B, 4 * planes, H', W')
        out = out + self._identity(x)  # (B, 4 * planes, H', W')
        return self.relu(out)


_BLOCKS: dict[str, type[_Block]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """Maps images (B, 3, H, W) to class logits (B, K)."""

    def __init__(
        self,
        block: type[_Block],
        layers: list[int],
        num_classes: int = 1000,
        *,
        small_input: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or min(layers) < 1:
            raise ConfigError(f"ResNet needs 4 stages of >= 1 block each, got layers={layers}")
        if num_classes < 1:
            raise ConfigError(f"ResNet num_classes must be >= 1, got {num_classes}")
        self.small_input = small_input
        if small_input:  # CIFAR stem: keep 32x32 resolution into layer1
            self.conv1 = _conv(3, 64, 3)
        else:  # ImageNet stem: 7x7 stride 2, then a 3x3 stride-2 max-pool (H / 4 into layer1)
            self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool: nn.MaxPool2d | None = (
            None if small_input else nn.MaxPool2d(3, stride=2, padding=1)
        )
        channels = 64
        stages: list[nn.Sequential] = []
        for i, (width, count) in enumerate(zip(_STAGE_WIDTHS, layers, strict=True)):
            blocks: list[nn.Module] = []
            for j in range(count):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(channels, width, stride))
                channels = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # (B, 64, H / 2, W / 2), or (B, 64, H, W) small
        if self.maxpool is not None:
            x = self.maxpool(x)  # (B, 64, H / 4, W / 4)
        x = self.layer1(x)  # (B, 64 e, H1, W1), e = block expansion
        x = self.layer2(x)  # (B, 128 e, H1 / 2, W1 / 2)
        x = self.layer3(x)  # (B, 256 e, H1 / 4, W1 / 4)
        x = self.layer4(x)  # (B, 512 e, H1 / 8, W1 / 8)
        x = self.avgpool(x)  # (B, 512 e, 1, 1)
        x = torch.flatten(x, 1)  # (B, 512 e)
        return self.fc(x)  # (B, K)


def resnet(name: str, num_classes: int = 1000, *, small_input: bool = False) -> nn.Module:
    """Build ResNet ``name`` (a key of VISION_MODELS) with torchvision's init and tensor names."""
    if name not in VISION_MODELS:
        raise RegistryError(f"unknown vision model {name!r}; known: {', '.join(VISION_MODELS)}")
    kind, layers = VISION_MODELS[name]
    return ResNet(_BLOCKS[kind], list(layers), num_classes, small_input=small_input)


def _listed(keys: list[str]) -> str:
    more = f", ... {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def load_state_dict_by_name(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, skip: Collection[str] = ()
) -> None:
    """Copy ``state_dict``'s tensors into ``model`` by name (e.g. a torchvision ResNet's).

    Keys in ``skip`` keep the model's own values (e.g. ``fc.weight``/``fc.bias`` when fine-tuning
    to other classes, ``conv1.weight`` for a small-input stem). A missing ``num_batches_tracked``
    (checkpoints from before PyTorch 0.4.1) keeps the model's counter. Raises ConfigError naming
    up to 5 missing, unexpected and wrong-shape keys each; nothing is loaded then.
    """
    own = model.state_dict()
    skipped = set(skip)
    given = {k: v for k, v in state_dict.items() if k not in skipped}
    missing = [
        k
        for k in own
        if k not in given and k not in skipped and not k.endswith("num_batches_tracked")
    ]
    unexpected = [k for k in given if k not in own]
    wrong = [
        f"{k} (model {tuple(own[k].shape)}, given {tuple(v.shape)})"
        for k, v in given.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        parts = [
            f"{label} {len(keys)}: {_listed(keys)}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("wrong shape", wrong),
            )
            if keys
        ]
        raise ConfigError(
            f"state dict does not fit {type(model).__name__}: {'; '.join(parts)}. Load one saved from "
            "the same architecture (model name, num_classes, small_input), or pass "
            "skip=[...] for the keys the model should keep its own values for"
        )
    with torch.no_grad():
        model.load_state_dict(given, strict=False)
