from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from slimline.candidate import Candidate
from slimline.compress.finetune import FinetuneConfig, distill, feature_loss
from slimline.compress.pruning import layers as depth_stage
from slimline.compress.pruning import step as prune_mod
from slimline.compress.pruning.depth import (
    LayerMapHooks,
    LayersConfig,
    StackInfo,
    check_depth_request,
    drop_layers,
    find_stack,
    layer_sensitivity,
    make_depth_plan,
)
from slimline.compress.pruning.sensitivity import Evaluator
from slimline.compress.pruning.step import PruneConfig, prune_step, restore_pruned
from slimline.errors import RecipeError
from slimline.export import export_module
from slimline.measure.runners import OrtRunner, TorchRunner
from slimline.recipe import recipe_from_dict
from slimline.task import Task, load_task

from .conftest import make_context

TINY_BERT = Path(__file__).parent / "tiny_bert_task.py"
FAST = {"steps": 20, "eval_every": 10, "val_batches": 2, "progress": False, "lr": 1e-3}


@pytest.fixture(scope="module")
def bert() -> Task:
    return load_task(str(TINY_BERT))


def _fp32(task: Task) -> Candidate:
    assert task.model is not None
    return Candidate("fp32-torch", "fp32", None, module=task.model())


def _cfg(layers: dict[str, Any], **kw: Any) -> PruneConfig:
    return PruneConfig(
        **{"layers": layers, "workers": 1, "progress": False, "finetune": FAST, **kw}
    )


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Plain(nn.Module):
    """A plain nn.ModuleList of residual blocks; block 2 adds (almost) nothing."""

    def __init__(self, depth: int = 5, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        with torch.no_grad():
            quiet: Any = self.blocks[2]
            quiet.fc.weight.mul_(1e-3)
            quiet.fc.bias.zero_()
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.inp(x)
        for block in self.blocks:
            y = block(y)
        return self.out(y)


# -- the stack -------------------------------------------------------------------------------------
def test_stack_is_found_in_a_bert_encoder_and_in_a_plain_module_list(bert: Task) -> None:
    assert bert.model is not None
    assert find_stack(bert.model()) == StackInfo("encoder.encoder.layer", 4, "BertLayer")
    assert find_stack(Plain()) == StackInfo("blocks", 5, "Block")
    assert find_stack(Plain(), "blocks").size == 5


def test_a_missing_stack_names_what_was_looked_for() -> None:
    with pytest.raises(RecipeError, match=r"looked for an nn\.ModuleList.*layers: \{path"):
        find_stack(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(RecipeError, match=r"'out' is a Linear.*module lists found: \['blocks'\]"):
        find_stack(Plain(), "out")
    with pytest.raises(RecipeError, match=r"'encoder.layers' is no module"):
        find_stack(Plain(), "encoder.layers")


# -- removal -------------------------------------------------------------------------------
def test_removal_is_real_and_updates_the_config(bert: Task) -> None:
    assert bert.model is not None
    model: Any = drop_layers(_copy(bert.model()), "encoder.encoder.layer", [0, 2, 3])  # a BERT
    assert len(model.encoder.encoder.layer) == 3
    assert model.encoder.config.num_hidden_layers == 3
    assert not any(k.startswith("encoder.encoder.layer.3.") for k in model.state_dict())
    assert bert.model().encoder.config.num_hidden_layers == 4  # the task's model is untouched
    x = {k: torch.from_numpy(v) for k, v in bert.sample_inputs(2).items()}
    assert model(**x).shape == (2, 32)


def _copy(module: Any) -> Any:
    import copy

    return copy.deepcopy(module)


# -- sensitivity and plan --------------------------------------------------------------------------
class _PlainTask:
    name, output_kind = "plain", "logits"

    def __init__(self, model: nn.Module) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((32, 4)).astype(np.float32)
        with torch.no_grad():
            self.labels = model(torch.from_numpy(self.x)).argmax(1).numpy()

    def eval_data(self) -> Any:
        yield {"x": self.x}, self.labels

    def metric(self, outputs: np.ndarray, labels: np.ndarray) -> float:
        return float((outputs.argmax(1) == labels).mean())


def test_sensitivity_ranks_the_layer_that_adds_nothing_first_and_the_plan_drops_it() -> None:
    model = Plain().eval()
    evaluator = Evaluator(model, _PlainTask(model), 32, {"x": torch.zeros(2, 4)})  # type: ignore[arg-type]
    stack = find_stack(model)
    table = layer_sensitivity(evaluator, stack, [1, 2, 3], 1.0)
    losses = {r["layer"]: r["loss"] for r in table["rows"]}
    assert min(losses, key=losses.__getitem__) == 2
    assert losses[2] < 1e-4 < max(losses.values())
    plan = make_depth_plan(LayersConfig(drop=1), stack, [1.0] * 5, 10, table)
    assert plan.dropped == [2] and plan.keep == [0, 1, 3, 4]
    assert plan.macs_removed == pytest.approx(0.1)
    two = make_depth_plan(LayersConfig(target=0.15), stack, [1.0] * 5, 10, table)
    assert len(two.dropped) == 2 and 2 in two.dropped and 0 not in two.dropped


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ({"drop": 4}, r"drops every layer of encoder\.encoder\.layer \(4 layers\)"),
        ({"drop": 3}, r"at most 2 can go.*keep_first_last: false"),
        ({"keep": [1, 2, 3]}, r"drops layer\(s\) \[0\].*keep_first_last"),
        ({"keep": [0, 1, 2, 3]}, r"keeps all 4 layers"),
        ({"keep": [0, 7]}, r"names layers \[7\]"),
        ({"target": 0.9}, r"target 90% of MACs is unreachable"),
    ],
)
def test_an_impossible_plan_is_an_error_before_any_work(
    bert: Task,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    layers: dict[str, Any],
    match: str,
) -> None:
    def no_work(*a: Any, **kw: Any) -> Any:
        raise AssertionError("work started before the plan was checked")

    monkeypatch.setattr(depth_stage, "layer_sensitivity", no_work)
    monkeypatch.setattr(depth_stage, "distill", no_work)
    monkeypatch.setattr(prune_mod, "resolve_data", no_work)
    with pytest.raises(RecipeError, match=match):
        prune_step(_cfg(layers), _fp32(bert), make_context(bert, tmp_path))


def test_dropping_every_layer_is_an_error_even_when_first_and_last_may_go() -> None:
    stack = StackInfo("blocks", 3, "Block")
    check_depth_request(LayersConfig(drop=2, keep_first_last=False), stack)
    with pytest.raises(RecipeError, match="drops every layer"):
        check_depth_request(LayersConfig(drop=3, keep_first_last=False), stack)


def test_layers_config_takes_exactly_one_request() -> None:
    with pytest.raises(ValueError, match="exactly one of drop, target, keep or latency"):
        LayersConfig(drop=1, target=0.2)
    with pytest.raises(ValueError, match="exactly one"):
        LayersConfig()
    rec = recipe_from_dict(
        {"name": "r", "task": "minilm",
         "steps": [{"prune": {"layers": {"drop": 2, "path": "encoder.encoder.layer"}}}]}
    )  # fmt: skip
    cfg = rec.steps[0]
    assert isinstance(cfg, PruneConfig) and cfg.layers == LayersConfig(
        drop=2, path="encoder.encoder.layer"
    )
    assert (
        not cfg.thins and PruneConfig().thins and PruneConfig(layers={"drop": 1}, width=True).thins
    )
    again = recipe_from_dict(rec.to_dict())
    assert again.steps[0] == cfg


# -- recovery: each student layer learns the teacher layer it came from ----------------------
def test_the_layer_map_pairs_each_kept_layer_with_its_teacher_layer(bert: Task) -> None:
    assert bert.model is not None
    teacher = bert.model()
    student = drop_layers(_copy(teacher), "encoder.encoder.layer", [0, 2, 3])
    hooks = LayerMapHooks("encoder.encoder.layer", "encoder.encoder.layer", [0, 2, 3])
    taps = hooks.feature_taps(student, teacher, FinetuneConfig())
    assert taps is not None
    x = {k: torch.from_numpy(v) for k, v in bert.sample_inputs(4).items()}
    with torch.no_grad():
        hidden = teacher.encoder(**x, output_hidden_states=True).hidden_states
        student(**x)
    s_out, t_out = taps[0].take(), taps[1].take()
    for tap in taps:
        tap.close()
    assert len(s_out) == len(t_out) == 3
    for j, i in enumerate([0, 2, 3]):  # hidden_states[i + 1] is teacher layer i's output
        torch.testing.assert_close(t_out[j], hidden[i + 1])
    # student layer 0 is teacher layer 0 unchanged; layer 1 (was 2) sees another input
    assert float(feature_loss(s_out[:1], t_out[:1], ["0"], x["attention_mask"])) < 1e-10
    assert float(feature_loss(s_out[1:2], t_out[1:2], ["1"], x["attention_mask"])) > 1e-6
    assert hooks.feature_taps(student, teacher, FinetuneConfig(feature_weight=0)) is None


def test_distillation_with_the_layer_map_pulls_kept_layers_to_their_teacher_layers() -> None:
    teacher = Plain().eval()
    student = drop_layers(_copy(teacher), "blocks", [0, 3, 4])
    hooks = LayerMapHooks("blocks", "blocks", [0, 3, 4])
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))

    def mapped_loss() -> float:
        taps = hooks.feature_taps(student, teacher, FinetuneConfig())
        assert taps is not None
        with torch.no_grad():
            student(x=x), teacher(x=x)
        loss = feature_loss(taps[0].take(), taps[1].take(), ["0", "1", "2"], None)
        for tap in taps:
            tap.close()
        return float(loss)

    def batches() -> Any:
        rng = np.random.default_rng(2)
        for _ in range(12):
            yield {"x": rng.standard_normal((16, 4)).astype(np.float32)}, None

    before = mapped_loss()
    cfg = FinetuneConfig(steps=60, eval_every=20, val_batches=2, progress=False, lr=1e-2,
                         patience=10, min_delta=0.0)  # fmt: skip
    distill(student, teacher, batches, cfg, output_kind="logits", hooks=hooks)
    assert mapped_loss() < 0.7 * before


# -- the step ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def depth_pruned(bert: Task, tmp_path_factory: pytest.TempPathFactory) -> tuple[Candidate, Any]:
    ctx = make_context(bert, tmp_path_factory.mktemp("depth"))
    return prune_step(_cfg({"drop": 1}), _fp32(bert), ctx), ctx


def test_step_drops_the_least_sensitive_layer_for_real(
    depth_pruned: tuple[Candidate, Any], bert: Task
) -> None:
    cand, _ = depth_pruned
    layers = cand.meta["layers"]
    plan, rows = layers["plan"], layers["sensitivity"]["rows"]
    assert layers["stack"] == "encoder.encoder.layer" and layers["block"] == "BertLayer"
    assert [r["layer"] for r in rows] == [1, 2]  # first and last kept
    least = min(rows, key=lambda r: (r["loss"], r["layer"]))["layer"]
    assert plan["dropped"] == [least] and len(plan["keep"]) == 3
    assert len(cand.module.encoder.encoder.layer) == 3
    assert cand.module.encoder.config.num_hidden_layers == 3
    assert cand.meta["params"]["after"] < cand.meta["params"]["before"]
    assert cand.meta["macs"]["removed"] == pytest.approx(plan["macs_removed"], rel=1e-6)
    assert layers["recovery"]["layer_map"] == [
        [f"encoder.encoder.layer.{j}", f"encoder.encoder.layer.{i}"]
        for j, i in enumerate(plan["keep"])
    ] or layers["recovery"]["layer_map"] == [
        (f"encoder.encoder.layer.{j}", f"encoder.encoder.layer.{i}")
        for j, i in enumerate(plan["keep"])
    ]
    assert cand.meta["rounds"] == [] and cand.meta["plan"] == {}


def test_depth_pruned_export_is_smaller_and_restores_from_the_state_dict(
    depth_pruned: tuple[Candidate, Any], bert: Task, tmp_path: Path
) -> None:
    cand, ctx = depth_pruned
    assert bert.model is not None
    full = export_module(bert.model(), bert.sample_inputs(2), tmp_path / "full.onnx", 17)
    assert cand.onnx is not None
    assert cand.onnx.stat().st_size < 0.9 * full.stat().st_size
    sample = bert.sample_inputs(8)
    want = TorchRunner("t", cand.module, 1).run(sample)
    np.testing.assert_allclose(OrtRunner("o", cand.onnx, 1).run(sample), want, atol=1e-4)
    restored = restore_pruned(ctx.workdir, cand.meta, bert)
    layers = restored.get_submodule("encoder.encoder.layer")
    assert isinstance(layers, nn.ModuleList) and len(layers) == 3
    np.testing.assert_allclose(TorchRunner("r", restored, 1).run(sample), want, atol=1e-6)
    assert len(bert.model().encoder.encoder.layer) == 4


def test_depth_and_width_in_one_step(bert: Task, tmp_path: Path) -> None:
    cfg = _cfg({"keep": [0, 2, 3]}, width=True, target=0.2, rounds=1, round_to=8,
               ratios=[0.25, 0.5], sensitivity_samples=16, keep_first_last=False)  # fmt: skip
    ctx = make_context(bert, tmp_path)
    cand = prune_step(cfg, _fp32(bert), ctx)
    assert len(cand.module.encoder.encoder.layer) == 3
    assert cand.meta["layers"]["sensitivity"] is None  # keep given: no layer sweep
    assert cand.meta["plan"] and [r["round"] for r in cand.meta["rounds"]] == [1]
    layer_macs = cand.meta["layers"]["plan"]["macs_removed"]
    assert cand.meta["macs"]["removed"] > layer_macs + 0.05  # thinned beyond the dropped layer
    sample = bert.sample_inputs(8)
    want = TorchRunner("t", cand.module, 1).run(sample)
    restored = restore_pruned(ctx.workdir, cand.meta, bert)
    np.testing.assert_allclose(TorchRunner("r", restored, 1).run(sample), want, atol=1e-6)


def test_a_run_killed_while_recovering_the_layers_continues_inside_the_recovery(
    bert: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = distill

    class Dies:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def load(self) -> Any:
            return self.inner.load()

        def save(self, state: dict[str, Any]) -> None:
            self.inner.save(state)
            raise KeyboardInterrupt

    def dies(*a: Any, **kw: Any) -> Any:
        kw["checkpoint"] = Dies(kw["checkpoint"])
        return real(*a, **kw)

    monkeypatch.setattr(depth_stage, "distill", dies)
    cfg = _cfg({"drop": 1})
    with pytest.raises(KeyboardInterrupt):
        prune_step(cfg, _fp32(bert), make_context(bert, tmp_path / "a"))
    swept: list[int] = []
    real_sweep = layer_sensitivity
    monkeypatch.setattr(depth_stage, "distill", real)

    def counted(*a: Any, **kw: Any) -> Any:
        swept.append(1)
        return real_sweep(*a, **kw)

    monkeypatch.setattr(depth_stage, "layer_sensitivity", counted)
    cand = prune_step(cfg, _fp32(bert), make_context(bert, tmp_path / "b"))
    recovery = cand.meta["layers"]["recovery"]["finetune"]
    assert recovery["resumed_from_step"] == 10 and recovery["steps"] == 20
    assert swept == []  # the layer sensitivity table came from the checkpoint
    assert len(cand.module.encoder.encoder.layer) == 3


# -- depth and width together, priced by measured latency ------------------------------------------
def _fake_benchmark(cands: list[Candidate], *a: Any, **kw: Any) -> dict[str, Any]:
    """A stand-in for the interleaved benchmark: latency proportional to the ONNX file's size
    (weights dominate these tiny graphs), so the test does not depend on this CPU's speed."""
    from slimline.measure.latency import summarize_latency

    out = {}
    for c in cands:
        assert c.onnx is not None
        ms = c.onnx.stat().st_size / 1e5
        out[c.name] = {"latency_ms": summarize_latency([np.full(5, ms)] * 3)}
    return out


def test_choose_takes_the_least_loss_among_the_options_fast_enough() -> None:
    from slimline.compress.pruning.pricing import Option, choose
    from slimline.errors import StepError

    opts = [
        Option("a", [], [0, 1, 2], 0.0, loss=0.0, ratio=1.0),
        Option("b", [1], [0, 2], 0.0, loss=0.05, ratio=0.66),
        Option("c", [], [0, 1, 2], 0.5, loss=0.02, ratio=0.72),
        Option("d", [1], [0, 2], 0.5, loss=0.09, ratio=0.45),
        Option("e", [], [0, 1, 2], 0.25, error="ExportError: failed"),
    ]
    assert choose(opts, 0.7).name == "b"
    assert choose(opts, 0.75).name == "c"
    with pytest.raises(StepError, match=r"no depth/width option reaches 0\.40x.*d, timed 0\.450x"):
        choose(opts, 0.4)


def test_a_latency_plan_prices_depth_and_width_options_and_ships_the_chosen_shape(
    bert: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slimline.measure.latency as latency

    monkeypatch.setattr(latency, "benchmark", _fake_benchmark)
    cfg = _cfg({"latency": 0.8, "widths": [0.5], "price_rounds": 2}, round_to=8,
               keep_first_last=False, rounds=1)  # fmt: skip
    ctx = make_context(bert, tmp_path)
    cand = prune_step(cfg, _fp32(bert), ctx)
    layers = cand.meta["layers"]
    options = layers["options"]
    assert [o["name"] for o in options] == [
        f"drop{k}-width{w}" for k in range(3) for w in ("0", "0.5")
    ]
    assert options[0]["ratio"] == 1.0 and options[0]["loss"] == pytest.approx(0.0, abs=1e-6)
    fits = [o for o in options if o["ratio"] <= 0.8]
    best = min(fits, key=lambda o: o["loss"])
    assert layers["plan"]["dropped"] == best["dropped"] and layers["width"] == best["width"]
    assert len(cand.module.encoder.encoder.layer) == 4 - len(best["dropped"])
    if best["width"] > 0:  # thinned as the option was timed: every group by the same share
        assert cand.meta["plan"] and set(cand.meta["plan"].values()) == {best["width"]}
    sample = bert.sample_inputs(4)
    restored = restore_pruned(ctx.workdir, cand.meta, bert)
    np.testing.assert_allclose(
        TorchRunner("r", restored, 1).run(sample),
        TorchRunner("t", cand.module, 1).run(sample),
        atol=1e-6,
    )


def test_a_width_only_step_keeps_its_cache_key() -> None:
    key = PruneConfig(target=0.3).key_dict()
    assert "layers" not in key and "width" not in key
    assert PruneConfig(layers={"drop": 1}).key_dict()["layers"]["drop"] == 1


def test_a_step_that_prunes_nothing_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="width: false without layers prunes nothing"):
        PruneConfig(width=False)
