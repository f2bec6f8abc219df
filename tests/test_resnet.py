"""ResNet family: torchvision's parameter counts and tensor names, loading by name, shapes, tracing."""

import pytest
import torch
import torch.nn.functional as F

from fusionllm.core.errors import ConfigError, RegistryError
from fusionllm.graph.trace import trace
from fusionllm.models.resnet import VISION_MODELS, load_state_dict_by_name, resnet

# published torchvision numbers for 1000 classes
TORCHVISION_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}
BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def torchvision_keys(name: str) -> list[str]:
    """torchvision's state-dict keys for ``name``, written from its _make_layer rule.

    A stage's first block has ``downsample`` (Sequential: .0 conv1x1, .1 BN) when its stride is 2
    or its input width differs from planes * expansion; bottlenecks have a third conv/BN.
    """
    kind, layers = VISION_MODELS[name]
    expansion, convs = (1, 2) if kind == "basic" else (4, 3)
    keys = ["conv1.weight", *(f"bn1.{b}" for b in BN)]
    channels = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), layers, strict=True), start=1):
        for j in range(count):
            prefix = f"layer{stage}.{j}"
            for c in range(1, convs + 1):
                keys += [f"{prefix}.conv{c}.weight", *(f"{prefix}.bn{c}.{b}" for b in BN)]
            if j == 0 and (stage > 1 or channels != planes * expansion):
                keys += [
                    f"{prefix}.downsample.0.weight",
                    *(f"{prefix}.downsample.1.{b}" for b in BN),
                ]
            channels = planes * expansion
    return keys + ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("name", list(TORCHVISION_PARAMS))
def test_parameter_counts_match_torchvision(name: str) -> None:
    with torch.device("meta"):
        model = resnet(name)
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS[name]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_state_dict_keys_match_torchvision(name: str) -> None:
    with torch.device("meta"):
        model = resnet(name)
    assert list(model.state_dict()) == torchvision_keys(name)


def test_state_dict_shapes_of_downsample_and_stem() -> None:
    with torch.device("meta"):
        sd = resnet("resnet50").state_dict()
        small = resnet("resnet18", 10, small_input=True).state_dict()
    assert sd["conv1.weight"].shape == (64, 3, 7, 7)
    assert sd["layer1.0.downsample.0.weight"].shape == (256, 64, 1, 1)
    assert sd["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)  # v1.5: stride on the 3x3
    assert sd["fc.weight"].shape == (1000, 2048)
    assert small["conv1.weight"].shape == (64, 3, 3, 3)
    assert small["fc.weight"].shape == (10, 512)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(RegistryError, match="resnet18, resnet34, resnet50, resnet101, resnet152"):
        resnet("resnet19")


def test_round_trip_by_name_gives_equal_outputs() -> None:
    torch.manual_seed(0)
    source, target = resnet("resnet18").eval(), resnet("resnet18").eval()
    for m in source.modules():  # non-trivial running statistics
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.equal(source(x), target(x))
        load_state_dict_by_name(target, source.state_dict())
        assert torch.equal(source(x), target(x))


def test_load_errors_name_the_keys() -> None:
    model = resnet("resnet18")
    sd = model.state_dict()
    missing = {k: v for k, v in sd.items() if k != "layer3.1.bn2.weight"}
    with pytest.raises(ConfigError, match=r"missing 1: layer3\.1\.bn2\.weight") as exc:
        load_state_dict_by_name(model, missing)
    assert "\n" not in str(exc.value)
    wrong = {**sd, "fc.weight": torch.zeros(10, 512), "extra.weight": torch.zeros(1)}
    with pytest.raises(
        ConfigError, match=r"fc\.weight \(model \(1000, 512\), given \(10, 512\)\)"
    ) as exc:
        load_state_dict_by_name(model, wrong)
    assert "unexpected 1: extra.weight" in str(exc.value)


def test_small_input_loads_imagenet_weights_except_conv1() -> None:
    imagenet, small = resnet("resnet18"), resnet("resnet18", small_input=True)
    with pytest.raises(ConfigError, match=r"wrong shape 1: conv1\.weight"):
        load_state_dict_by_name(small, imagenet.state_dict())
    old_format = {
        k: v for k, v in imagenet.state_dict().items() if not k.endswith("num_batches_tracked")
    }
    load_state_dict_by_name(small, old_format, skip=["conv1.weight"])
    assert torch.equal(small.layer4[1].conv2.weight, imagenet.layer4[1].conv2.weight)


def test_forward_shapes() -> None:
    model = resnet("resnet18").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 224, 224)).shape == (2, 1000)
    small = resnet("resnet18", num_classes=10, small_input=True)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("granularity", ["layer", "fine"])
def test_traces_in_train_mode_with_batch_norm_buffers(granularity: str) -> None:
    torch.manual_seed(0)
    model = resnet("resnet18", num_classes=10, small_input=True).train()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    graph = trace(
        model,
        (x,),
        loss=F.cross_entropy,
        loss_inputs=(y,),
        input_names=["images", "labels"],
        granularity=granularity,
    )
    bns = [n for n in graph.nodes if n.kind == "module:torch.nn.BatchNorm2d"]
    # layer: only the stem's BN (each block is one node); fine: stem + 2 per block + 3 downsample
    assert len(bns) == (1 if granularity == "layer" else 1 + 16 + 3)
    for n in bns:
        assert {"running_mean", "running_var", "num_batches_tracked"} <= set(n.params)
    assert set(graph.params) == set(model.state_dict())
    assert graph.loss is not None
    if granularity == "layer":
        blocks = [n for n in graph.nodes if n.kind == "module:fusionllm.models.resnet.BasicBlock"]
        assert len(blocks) == 8
        assert blocks[2].config == {"in_channels": 64, "planes": 128, "stride": 2}
        assert "downsample.1.running_var" in blocks[2].params
