from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from slimline.compress.finetune import (
    DistillHooks,
    EarlyStopping,
    FinetuneConfig,
    TrainingStep,
    accumulate_gradients,
    distill,
    distill_loss,
    held_out_batches,
    resolve_data,
)
from slimline.errors import DataError
from slimline.task import Task


def _batches(n: int = 12, labels: bool = True) -> Any:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((32, 16)).astype(np.float32) for _ in range(n)]

    def gen() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        for x in xs:
            yield {"x": x}, (x[:, :4].argmax(1) if labels else None)

    return gen


class Net(nn.Module):
    def __init__(self, out: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, out)

    def forward(self, x: torch.Tensor) -> Any:
        return self.b(torch.relu(self.a(x)))


def _pair(out: int = 4) -> tuple[Net, Net]:
    torch.manual_seed(0)
    teacher = Net(out).eval()
    with torch.no_grad():
        teacher.b.weight.mul_(5.0)  # confident logits, so top-1 agreement is a stable measure
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.a.weight.add_(0.3 * torch.randn_like(student.a.weight))
    return teacher, student


def _agreement(a: nn.Module, b: nn.Module, data: Any) -> float:
    with torch.no_grad():
        hits = [
            (a(torch.from_numpy(x["x"])).argmax(1) == b(torch.from_numpy(x["x"])).argmax(1))
            .float()
            .mean()
            for x, _ in data()
        ]
    return float(torch.stack(hits).mean())


CFG = FinetuneConfig(steps=150, lr=1e-2, eval_every=25, patience=3, val_batches=2, progress=False)


def _rows_batches(n: int, rows: int) -> Any:
    def gen() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        for i in range(n):
            yield {"x": np.full((rows, 2), i, np.float32)}, None

    return gen


@pytest.mark.parametrize(
    ("n", "rows", "val_batches", "min_rows", "held", "skip"),
    [
        (48, 2, 4, 16, 8, 8),  # small batches of large inputs: 8 batches hold 16 rows
        (12, 32, 2, 16, 2, 2),  # the batches already hold 16 rows: unchanged
        (16, 2, 4, 16, 4, 4),  # not over twice 8 batches: val_batches, as before
        (17, 2, 4, 16, 8, 8),  # 9 batches left to train on
        (48, 2, 4, 0, 4, 4),  # min_val_rows 0: val_batches
        (48, 3, 4, 16, 6, 6),  # ceil(16 / 3)
        (4, 2, 4, 16, 2, 0),  # too little to hold any out: half, trained on too
    ],
)
def test_the_held_out_batches_reach_min_val_rows_where_the_data_allows(
    n: int, rows: int, val_batches: int, min_rows: int, held: int, skip: int
) -> None:
    cfg = FinetuneConfig(val_batches=val_batches, min_val_rows=min_rows, progress=False)
    val, skipped = held_out_batches(_rows_batches(n, rows), cfg)
    assert [int(x["x"][0, 0]) for x, _ in val] == list(range(held))  # the leading ones
    assert skipped == skip


def test_no_batches_to_hold_out_is_a_data_error() -> None:
    with pytest.raises(DataError, match="yielded no batches"):
        held_out_batches(_rows_batches(0, 2), FinetuneConfig(progress=False))


def test_logit_distillation_recovers_the_teacher() -> None:
    teacher, student = _pair()
    data = _batches(labels=False)
    before = _agreement(teacher, student, data)
    res = distill(student, teacher, data, CFG, output_kind="logits")
    assert res.val_after < 0.25 * res.val_before
    assert _agreement(teacher, student, data) > before + 0.15
    assert not student.training


def test_embedding_distillation_by_cosine_and_mse() -> None:
    for loss in ("cosine", "mse"):
        teacher, student = _pair(out=8)
        res = distill(
            student,
            teacher,
            _batches(labels=False),
            CFG.model_copy(update={"embedding_loss": loss}),
            output_kind="embedding",
        )
        assert res.val_after < 0.5 * res.val_before, loss


def test_early_stop_when_nothing_is_gained() -> None:
    teacher, _ = _pair()
    student = copy.deepcopy(teacher)  # already perfect: no evaluation can improve
    res = distill(
        student,
        teacher,
        _batches(),
        CFG.model_copy(update={"eval_every": 5, "patience": 2}),
        output_kind="logits",
    )
    assert res.stopped_early and res.steps == 10
    for p, q in zip(student.parameters(), teacher.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # the best (initial) weights are kept


def test_kd_loss_has_task_term_with_labels() -> None:
    s, t = torch.randn(8, 4), torch.randn(8, 4)
    labels = np.arange(8) % 4
    pure = distill_loss(s, t, None, "logits", CFG)
    mixed = distill_loss(s, t, labels, "logits", CFG)
    ce = nn.functional.cross_entropy(s, torch.as_tensor(labels))
    assert float(mixed) == pytest.approx(
        CFG.alpha * float(pure) + (1 - CFG.alpha) * float(ce), rel=1e-5
    )


def _task(train: bool) -> Task:
    return Task(
        name="t",
        source="t",
        calibration_data=lambda: iter([{"x": np.zeros((2, 16), np.float32)}]),
        eval_data=lambda: iter([]),
        metric=lambda o, y: 0.0,
        train_data=_batches() if train else None,
    )


def test_data_resolution_falls_back_and_says_so() -> None:
    data, source, note = resolve_data(_task(False), FinetuneConfig())
    assert source == "calibration" and note is not None and "calibration inputs" in note
    ((inputs, labels),) = list(data())
    assert labels is None and inputs["x"].shape == (2, 16)
    assert resolve_data(_task(True), FinetuneConfig())[1:] == ("train", None)
    with pytest.raises(DataError, match=r"no train_data.*data: calibration"):
        resolve_data(_task(False), FinetuneConfig(data="train"))


def test_gradients_for_taylor_need_a_signal() -> None:
    teacher, student = _pair()
    assert accumulate_gradients(student, teacher, _batches(), 3, output_kind="logits") == 3
    assert student.a.weight.grad is not None and float(student.a.weight.grad.abs().sum()) > 0
    emb_t, emb_s = _pair(out=8)
    assert (
        accumulate_gradients(emb_s, emb_t, _batches(labels=False), 3, output_kind="embedding") == 0
    )


def test_dynamic_padding_cuts_only_all_padding_columns() -> None:
    from slimline.compress.finetune import trim_padding

    from .test_prune_graph import Encoder

    ids = np.random.default_rng(0).integers(1, 100, (3, 12)).astype(np.int64)
    mask = np.zeros((3, 12), np.int64)
    mask[0, :5], mask[1, :7], mask[2, :3] = 1, 1, 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    cut = trim_padding(inputs)
    assert cut["input_ids"].shape == (3, 7) and cut["attention_mask"].shape == (3, 7)
    enc = Encoder()
    with torch.no_grad():
        full = enc(**{k: torch.from_numpy(v) for k, v in inputs.items()})[:, :7]
        short = enc(**{k: torch.from_numpy(v) for k, v in cut.items()})
    keep = torch.from_numpy(mask[:, :7]).bool()
    torch.testing.assert_close(short[keep], full[keep], atol=1e-5, rtol=1e-4)
    assert trim_padding({"x": ids}) == {"x": ids}  # no mask: untouched


def _hidden_error(student: Net, teacher: Net, data: Any) -> float:
    """Relative squared error of the first layer's output, student against teacher."""
    with torch.no_grad():
        err = [
            float(((student.a(x) - teacher.a(x)) ** 2).sum() / (teacher.a(x) ** 2).sum())
            for x in (torch.from_numpy(b["x"]) for b, _ in data())
        ]
    return float(np.mean(err))


def test_feature_distillation_pulls_hidden_states_to_the_teacher() -> None:
    data = _batches(labels=False)
    teacher, plain = _pair()
    feat = copy.deepcopy(plain)
    before = _hidden_error(plain, teacher, data)
    base = FinetuneConfig(steps=60, lr=1e-2, eval_every=60, progress=False)
    distill(plain, teacher, data, base, output_kind="logits")
    distill(feat, teacher, data,
            base.model_copy(update={"features": "a", "feature_weight": 1.0}), output_kind="logits")  # fmt: skip
    # matching the outputs alone leaves the hidden layer where it is; matching it too moves it
    assert _hidden_error(feat, teacher, data) < 0.5 * _hidden_error(plain, teacher, data)
    assert _hidden_error(feat, teacher, data) < 0.5 * before
    assert all(not m._forward_hooks for m in feat.modules())  # hooks removed afterwards


def test_feature_distillation_names_a_bad_module_pattern_or_shape() -> None:
    from slimline.errors import RecipeError

    teacher, student = _pair()
    with pytest.raises(RecipeError, match="matches no module"):
        distill(student, teacher, _batches(), FinetuneConfig(steps=2, features="nope",
                progress=False), output_kind="logits")  # fmt: skip
    narrow = Net()
    narrow.a, narrow.b = nn.Linear(16, 24), nn.Linear(24, 4)  # a pruned hidden layer
    with pytest.raises(RecipeError, match=r"module a outputs \(32, 24\)"):
        distill(narrow, teacher, _batches(), FinetuneConfig(steps=2, features="a",
                progress=False), output_kind="logits")  # fmt: skip


class _FileCheckpoint:
    """A training checkpoint kept the way the prune step keeps it (torch.save, loaded with
    weights_only=True); ``die_after`` saves raises KeyboardInterrupt, as a killed run."""

    def __init__(self, path: Any, die_after: int | None = None) -> None:
        self.path, self.die_after, self.saves = path, die_after, 0

    def load(self) -> dict[str, Any] | None:
        return torch.load(self.path, weights_only=True) if self.path.is_file() else None

    def save(self, state: dict[str, Any]) -> None:
        torch.save(state, self.path)
        self.saves += 1
        if self.saves == self.die_after:
            raise KeyboardInterrupt


def test_a_killed_fine_tune_continues_from_its_checkpoint_to_the_same_weights(
    tmp_path: Any,
) -> None:
    """Killed after the step-20 checkpoint, a second call trains steps 21-40 only and ends with
    the weights an uninterrupted run reaches: optimizer, schedule and data position restored."""
    cfg = CFG.model_copy(update={"steps": 40, "eval_every": 10, "patience": 100})
    teacher, start = _pair()
    whole = copy.deepcopy(start)
    torch.manual_seed(1)
    full = distill(whole, teacher, _batches(), cfg, output_kind="logits")

    ckpt = _FileCheckpoint(tmp_path / "ft.pt", die_after=2)
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        distill(
            copy.deepcopy(start), teacher, _batches(), cfg, output_kind="logits", checkpoint=ckpt
        )
    again = copy.deepcopy(start)
    seen: list[int] = []
    res = distill(
        again,
        teacher,
        _batches(),
        cfg,
        output_kind="logits",
        checkpoint=_FileCheckpoint(tmp_path / "ft.pt"),
        on_step=lambda i, _: seen.append(i),
    )
    assert res.resumed_from_step == 20 and seen == list(range(21, 41)) and res.steps == 40
    assert [h["step"] for h in res.history] == [h["step"] for h in full.history]
    assert res.best_step == full.best_step and res.val_after == pytest.approx(full.val_after)
    for p, q in zip(again.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q)


class _Recorder(DistillHooks):
    """Freezes layer ``a``'s learning rate through the hook points and records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def prepare_student(self, student: Any) -> None:
        self.calls.append(("prepare", 0))

    def param_groups(self, student: Any, params: list[Any]) -> list[dict[str, Any]]:
        frozen = set(map(id, student.a.parameters()))
        return [
            {"params": [p for p in params if id(p) in frozen], "lr": 0.0},
            {"params": [p for p in params if id(p) not in frozen]},
        ]

    def before_forward(self, step: int, student: Any) -> None:
        self.calls.append(("forward", step))

    def on_step(self, step: int, loss: float) -> None:
        self.calls.append(("step", step))


def test_hooks_plug_into_the_loop_without_changing_it() -> None:
    cfg = FinetuneConfig(steps=6, eval_every=3, patience=10, lr=1e-2, progress=False)
    teacher, plain = _pair()
    hooked = copy.deepcopy(plain)
    again = copy.deepcopy(hooked)
    torch.manual_seed(1)
    distill(again, teacher, _batches(), cfg, output_kind="logits", hooks=DistillHooks())
    torch.manual_seed(1)
    baseline = copy.deepcopy(hooked)
    distill(baseline, teacher, _batches(), cfg, output_kind="logits")
    for p, q in zip(again.parameters(), baseline.parameters(), strict=True):
        assert torch.equal(p, q)  # default hooks: the same weights as no hooks
    assert not torch.equal(baseline.a.weight, plain.a.weight)  # and training did change them
    rec, before_a = _Recorder(), hooked.a.weight.detach().clone()
    distill(hooked, teacher, _batches(), cfg, output_kind="logits", hooks=rec)
    assert rec.calls[0] == ("prepare", 0)
    assert rec.calls[1:] == [(kind, s) for s in range(1, 7) for kind in ("forward", "step")]
    assert torch.equal(hooked.a.weight, before_a)  # its parameter group's lr is 0
    assert not torch.equal(hooked.b.weight, plain.b.weight)  # the other group trained


class NormNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> Any:
        return self.b(torch.relu(self.norm(self.a(x))))


def test_a_teacher_in_training_mode_is_only_run_never_changed() -> None:
    torch.manual_seed(0)
    teacher = NormNet().train()  # BatchNorm in training mode would update its statistics
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = copy.deepcopy(teacher).eval()
    cfg = FinetuneConfig(steps=4, eval_every=2, val_batches=2, progress=False, features="a")
    distill(student, teacher, _batches(), cfg, output_kind="logits")
    accumulate_gradients(student, teacher, _batches(), 2, output_kind="logits")
    assert all(m.training for m in teacher.modules())
    assert all(torch.equal(v, state[k]) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    assert all(not m._forward_hooks for m in teacher.modules())


class DropNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> Any:
        return self.b(self.drop(torch.relu(self.a(x))))


class _TrainingOutputs(DistillHooks):
    """Runs the student twice on one input before every step: equal outputs = no dropout."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.equal: list[bool] = []

    def before_forward(self, step: int, student: Any) -> None:
        with torch.no_grad():
            self.equal.append(torch.equal(student(self.x), student(self.x)))


def test_dropout_off_while_distilling_and_restored_after() -> None:
    torch.manual_seed(0)
    teacher = DropNet().eval()
    x = torch.from_numpy(next(iter(_batches()()))[0]["x"])
    runs: dict[bool, list[bool]] = {}
    for dropout in (True, False):
        student = copy.deepcopy(teacher)
        hooks = _TrainingOutputs(x)
        cfg = FinetuneConfig(steps=4, eval_every=2, lr=1e-2, progress=False, dropout=dropout)
        distill(student, teacher, _batches(), cfg, output_kind="logits", hooks=hooks)
        runs[dropout] = hooks.equal
        assert student.drop.p == 0.5  # the module's own rate is back
    assert runs[False] == [True] * 4 and runs[True] == [False] * 4
    assert "dropout" not in FinetuneConfig().key_dict()  # the default keeps old cache keys
    assert FinetuneConfig(dropout=False).key_dict()["dropout"] is False


def test_bce_distillation_of_probabilities_is_zero_at_the_teacher_and_checks_the_range() -> None:
    from slimline.errors import RecipeError

    cfg = FinetuneConfig(embedding_loss="bce")
    t = torch.tensor([[0.1, 0.9, 0.5, 1e-9]])
    assert float(distill_loss(t.clone(), t, None, "other", cfg)) == pytest.approx(0.0, abs=1e-6)
    near = float(distill_loss(torch.tensor([[0.1, 0.8, 0.5, 1e-9]]), t, None, "other", cfg))
    far = float(distill_loss(torch.tensor([[0.1, 0.3, 0.5, 1e-9]]), t, None, "other", cfg))
    assert 0.0 < near < far
    with pytest.raises(RecipeError, match="probabilities"):
        distill_loss(torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 0.5]]), None, "other", cfg)


def test_bce_rows_weighs_an_error_by_its_rows_text_area_at_bces_scale() -> None:
    """The same one-pixel error costs plain bce the same in any row; bce_rows weighs it by the
    inverse of the row's text area, so it costs more in the row with less text."""
    t = torch.zeros(2, 1, 10, 10)
    t[0, :, :5] = 0.9  # half the page is text
    t[1, :, 0, :2] = 0.9  # two pixels of text
    in_big, in_small = t.clone(), t.clone()
    in_big[0, :, 0, 0] = 0.1
    in_small[1, :, 0, 0] = 0.1
    plain, rows = FinetuneConfig(embedding_loss="bce"), FinetuneConfig(embedding_loss="bce_rows")
    assert float(distill_loss(in_big, t, None, "map", plain)) == pytest.approx(
        float(distill_loss(in_small, t, None, "map", plain))
    )
    big, small = (float(distill_loss(x, t, None, "map", rows)) for x in (in_big, in_small))
    assert small > 10 * big
    assert float(distill_loss(t.clone(), t, None, "map", rows)) == pytest.approx(0.0, abs=1e-6)
    same = torch.full((3, 1, 4, 4), 0.5)  # equal areas: equal weights, plain bce's value
    moved = same.clone()
    moved[:, :, 0, 0] = 0.2
    assert float(distill_loss(moved, same, None, "map", rows)) == pytest.approx(
        float(distill_loss(moved, same, None, "map", plain)), rel=1e-4
    )


def test_one_training_step_lowers_the_batchs_distillation_loss() -> None:
    teacher, student = _pair()
    cfg = FinetuneConfig(steps=10, progress=False)
    train = TrainingStep(student, teacher, cfg, 1e-2, "logits", None, DistillHooks())
    inputs, _ = next(iter(_batches()()))
    first = train(1, inputs, None)
    for i in range(2, 6):
        last = train(i, inputs, None)
    assert last < first and train.sched.last_epoch == 5


def test_a_training_step_puts_dropout_back_when_closed() -> None:
    teacher, _ = _pair()
    student = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4))
    train = TrainingStep(student, teacher, FinetuneConfig(dropout=False), 1e-3, "logits", None,
                         DistillHooks())  # fmt: skip
    train.open()
    assert student[1].p == 0.0
    train.close()
    assert student[1].p == 0.3


def test_early_stopping_keeps_the_best_weights_and_stops_after_patience() -> None:
    net = nn.Linear(2, 1)
    stop = EarlyStopping(net, 1.0, min_delta=0.1, patience=2)
    with torch.no_grad():
        net.weight.fill_(7.0)
    assert not stop.update(1, 0.5, net)  # improved: these weights are now the best
    with torch.no_grad():
        net.weight.fill_(-1.0)
    assert not stop.update(2, 0.46, net)  # within min_delta of 0.5: not an improvement
    assert stop.update(3, 0.6, net)  # the second evaluation without one: stop
    assert stop.best == 0.5 and stop.step == 1 and float(stop.state["weight"][0, 0]) == 7.0


def test_a_checkpointed_run_continues_exactly_where_it_stopped() -> None:
    """The training state saved at an evaluation, loaded into a fresh run, gives the same
    weights as the run that never stopped."""
    saved: dict[str, Any] = {}

    class Keep:
        def load(self) -> dict[str, Any] | None:
            return copy.deepcopy(saved.get("state"))

        def save(self, state: dict[str, Any]) -> None:
            if state["step"] == 4:
                saved["state"] = copy.deepcopy(state)

    cfg = FinetuneConfig(steps=8, eval_every=2, patience=100, progress=False)
    teacher, student = _pair()
    torch.manual_seed(1)
    distill(student, teacher, _batches(), cfg, output_kind="logits", checkpoint=Keep())
    _, resumed = _pair()
    result = distill(resumed, teacher, _batches(), cfg, output_kind="logits", checkpoint=Keep())
    assert result.resumed_from_step == 4 and result.steps == 8
    for a, b in zip(student.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
