from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch_pruning as tp
from torch import nn

from slimline.compress.pruning.graph import (
    CostModel,
    PruneGraph,
    apply_history,
    count_macs_params,
    keep_units,
)
from slimline.errors import StepError


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetish(nn.Module):
    """Residual adds, a depthwise conv and a linear bottleneck: the couplings DepGraph handles."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.b1 = Block(16)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.b2 = Block(32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.fc1 = nn.Linear(32, 64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.b2(torch.relu(self.down(self.b1(torch.relu(self.stem(x))))))
        y = torch.relu(self.dw(y)).mean((2, 3))
        return self.fc(torch.relu(self.fc1(y)))


def _net() -> ResNetish:
    torch.manual_seed(0)
    net = ResNetish()
    for m in net.modules():  # non-trivial BN statistics so pruning changes outputs measurably
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


EX = {"x": torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))}
L2 = tp.importance.GroupMagnitudeImportance(p=2)


def test_groups_follow_residual_depthwise_and_exclusions() -> None:
    g = PruneGraph(_net(), EX)
    # the stem's residual stream (first layer) and fc (output layer) are excluded
    assert set(g.groups) == {"b1.conv1", "b2.conv1", "down", "fc1"}
    stream = g.groups["down"]  # residual stream of stage 2: down, b2.conv2, the depthwise conv
    assert {"down", "b2.conv2", "dw", "b2.bn2"} <= set(stream.outputs)
    assert "fc1" in stream.modules and "b2.conv1" in stream.modules  # their inputs follow
    assert all(g.units(n) == grp.size for n, grp in g.groups.items())
    coarse = PruneGraph(_net(), EX, round_to=16)
    assert coarse.skipped == {"b1.conv1": "16 channels cannot be rounded below 16"}


def test_first_last_exclusion_can_be_turned_off_and_patterns_exclude() -> None:
    g = PruneGraph(_net(), EX, keep_first_last=False, round_to=1)
    assert "stem" in g.groups and "b1.conv1" in g.groups
    g2 = PruneGraph(_net(), EX, exclude=["b2.*"], round_to=1)
    assert "b2.conv1" not in g2.groups and "down" not in g2.groups  # b2.conv2 is in the stream


def test_pruning_shrinks_layers_and_keeps_the_model_running() -> None:
    net = _net()
    g = PruneGraph(net, EX)
    before = count_macs_params(net, EX)
    assert g.prune_to("down", 16, L2) == 16
    assert g.prune_to("b2.conv1", 8, L2) == 24
    assert net.down.out_channels == 16 and net.dw.in_channels == 16 and net.dw.groups == 16
    assert net.b2.conv1.out_channels == 8 and net.b2.conv2.in_channels == 8
    assert net.fc1.in_features == 16 and net.fc.out_features == 10
    after = count_macs_params(net, EX)
    assert after[0] < 0.7 * before[0] and after[1] < before[1]
    assert net(**EX).shape == (2, 10)


def test_magnitude_order_removes_the_weakest_channels() -> None:
    net = _net()
    with torch.no_grad():
        net.fc1.weight[5].zero_()
        net.fc1.bias[5] = 0.0
        net.fc.weight[:, 5].zero_()
    g = PruneGraph(net, EX)
    assert g.removal_order("fc1", L2)[0] == 5


def test_cost_model_matches_the_op_counter() -> None:
    net = _net()
    g = PruneGraph(net, EX)
    cost = CostModel(g)
    plan = {"down": 16, "b2.conv1": 8, "fc1": 24}
    for name, keep in plan.items():
        g.prune_to(name, keep, L2)
    macs, params = count_macs_params(net, EX)
    pred_macs, pred_params = cost.cost({n: k / g.groups[n].size for n, k in plan.items()})
    assert pred_params == pytest.approx(params, rel=1e-6)
    assert pred_macs == pytest.approx(macs, rel=2e-3)


def test_history_replays_on_a_fresh_model() -> None:
    net = _net()
    g = PruneGraph(net, EX)
    g.prune_to("down", 24, L2)
    g.prune_to("fc1", 40, L2)
    fresh = apply_history(_net(), EX, g.history())
    fresh.load_state_dict(net.state_dict())
    torch.testing.assert_close(fresh(**EX), net(**EX))


@pytest.mark.parametrize(
    ("size", "ratio", "kind", "expect"),
    [
        (64, 0.3, "channels", 48),
        (64, 0.0, "channels", 64),
        (20, 0.0, "channels", 20),
        (44, 0.8, "channels", 16),
        (16, 0.3, "channels", 8),
        (16, 0.2, "channels", 16),
        (12, 0.25, "heads", 9),
        (12, 0.8, "heads", 3),
    ],
)
def test_keep_units_rounds_and_respects_the_cap(
    size: int, ratio: float, kind: str, expect: int
) -> None:
    keep = keep_units(size, ratio, kind, 8, 0.8)  # type: ignore[arg-type]
    assert keep == expect
    assert (size - keep) / size <= 0.8 + 1e-9
    if kind == "channels" and keep < size:
        assert keep % 8 == 0


class Opaque(nn.Module):
    """Breaks the autograd trace (numpy round trip), hiding a coupling from the dependency graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x.detach().numpy()))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 32, 3, padding=1)
        self.hide = Opaque()
        self.c = nn.Conv2d(32, 32, 3, padding=1)
        self.d = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> Any:
        y = torch.relu(self.b(torch.relu(self.a(x))))
        z = self.c(self.hide(y)) + self.d(y)  # c's input comes through the opaque module
        return self.fc(z.mean((2, 3)))


def test_an_untraced_coupling_fails_loudly_naming_the_module() -> None:
    g = PruneGraph(Untraceable().eval(), {"x": torch.randn(2, 1, 8, 8)})
    assert "b" in g.groups  # the graph does not see that c consumes b's channels
    with pytest.raises(StepError, match=r"after pruning group 'b' the model fails in module 'c'"):
        g.prune_to("b", 16, L2)


class Crashes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), Boom())

    def forward(self, x: torch.Tensor) -> Any:
        return self.inner(self.a(x))


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            raise RuntimeError("data-dependent branch the tracer cannot follow")
        return x


def test_a_model_that_fails_while_tracing_names_the_module() -> None:
    with pytest.raises(StepError, match=r"cannot trace the model.*in module 'inner\.1'"):
        PruneGraph(Crashes().eval(), {"x": torch.randn(2, 4)})


# -- BERT-class encoders ----------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=32,
        )
        self.bert = BertModel(cfg, add_pooling_layer=False).eval()  # type: ignore[no-untyped-call]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


TOKENS = {
    "input_ids": torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(0)),
    "attention_mask": torch.ones(2, 10, dtype=torch.long),
}


def test_encoder_groups_are_heads_and_ffn_neurons() -> None:
    g = PruneGraph(Encoder(), TOKENS, keep_first_last=False)
    kinds = {n: (grp.kind, grp.size, grp.unit) for n, grp in g.groups.items()}
    for i in range(2):
        assert kinds[f"bert.encoder.layer.{i}.attention.self"] == ("heads", 4, 16)
        assert kinds[f"bert.encoder.layer.{i}.intermediate.dense"] == ("channels", 128, 1)
    assert len(kinds) == 4  # the hidden size feeds the output: never pruned


def test_removing_heads_equals_silencing_them() -> None:
    enc = Encoder()
    ref = copy.deepcopy(enc)
    attn = ref.bert.encoder.layer[1].attention.self
    with torch.no_grad():  # a head whose values are zero contributes nothing
        for h in (0, 2):
            attn.value.weight[h * 16 : (h + 1) * 16] = 0.0
            attn.value.bias[h * 16 : (h + 1) * 16] = 0.0
    g = PruneGraph(enc, TOKENS)
    g.remove("bert.encoder.layer.1.attention.self", [0, 2])
    pruned = enc.bert.encoder.layer[1].attention.self
    assert pruned.num_attention_heads == 2 and pruned.query.out_features == 32
    assert enc.bert.encoder.layer[1].attention.output.dense.in_features == 32
    torch.testing.assert_close(enc(**TOKENS), ref(**TOKENS), atol=1e-5, rtol=1e-4)


def test_encoder_ffn_pruning_and_replay() -> None:
    enc = Encoder()
    g = PruneGraph(enc, TOKENS)
    cost = CostModel(g)
    g.prune_to("bert.encoder.layer.0.intermediate.dense", 64, L2)
    g.prune_to("bert.encoder.layer.1.attention.self", 3, L2)
    assert enc.bert.encoder.layer[0].output.dense.in_features == 64
    pred = cost.cost(
        {
            "bert.encoder.layer.0.intermediate.dense": 0.5,
            "bert.encoder.layer.1.attention.self": 0.75,
        }
    )
    assert pred[1] == pytest.approx(count_macs_params(enc, TOKENS)[1], rel=1e-6)
    fresh = apply_history(Encoder(), TOKENS, g.history())
    fresh.load_state_dict(enc.state_dict())
    torch.testing.assert_close(fresh(**TOKENS), enc(**TOKENS))
