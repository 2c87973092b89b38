"""Tiny fixture models and helpers for the quantization tests: a residual CNN, a BERT-shaped
encoder, a task and a step context built the way the pipeline builds them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from slimline import StepContext, api
from slimline.candidate import Candidate
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.plan import PrecisionPlan
from slimline.compress.quant.trial import Search, Trial
from slimline.export import export_module
from slimline.measure.latency import summarize_latency
from slimline.measure.quality import Reference
from slimline.recipe import Recipe, recipe_from_dict
from slimline.task import Task


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.b2 = nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1)
        self.b3 = nn.BatchNorm2d(32)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> Any:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        x = torch.relu(self.b3(self.c3(x)) + x)
        x = torch.relu(self.c4(x))
        return self.fc(x.mean((2, 3)))


class Layer(nn.Module):
    """A BERT layer written the way Hugging Face's eager BERT is (so ORT can fuse it)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dh = heads, hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ff1, self.ff2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.dh).permute(0, 2, 1, 3)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> Any:
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh) + mask
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
        h = self.ln1(self.o(ctx.view(h.shape)) + h)
        return self.ln2(self.ff2(nn.functional.gelu(self.ff1(h))) + h)


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 100, hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(64, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
        h = self.ln(self.emb(input_ids) + self.pos(pos))
        m = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            h = layer(h, m)
        w = attention_mask.unsqueeze(-1).float()
        return (h * w).sum(1) / w.sum(1)


def cnn_inputs(seed: int, n: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": (scale * np.random.RandomState(seed).randn(n, 3, 16, 16)).astype(np.float32)}


def text_inputs(seed: int, n: int, seq: int = 16) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {
        "input_ids": rs.randint(1, 100, (n, seq)).astype(np.int64),
        "attention_mask": np.ones((n, seq), np.int64),
    }


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    m = cls()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            assert mod.running_mean is not None and mod.running_var is not None
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


@pytest.fixture(scope="session")
def cnn_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    return export_module(_seeded(TinyCNN), cnn_inputs(0, 2), path)


@pytest.fixture(scope="session")
def encoder_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("enc") / "encoder.onnx"
    return export_module(_seeded(TinyEncoder), text_inputs(0, 2), path)


def batches(
    make: Any, n_batches: int, rows: int, seed: int = 0, **kw: Any
) -> Iterator[dict[str, np.ndarray]]:
    for i in range(n_batches):
        yield make(seed + i, rows, **kw)


def cnn_task(onnx_path: Path, eval_scale: float = 1.0, calib_batches: int = 4) -> Task:
    from slimline.measure.runners import OrtRunner

    runner = OrtRunner("ref", onnx_path, 1)

    def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
        for i in range(2):
            x = cnn_inputs(100 + i, 32, eval_scale)
            yield x, runner.run(x).argmax(1)  # labels: the FP32 model's own answers

    return Task(
        name="tinycnn",
        source="tests",
        calibration_data=lambda: batches(cnn_inputs, calib_batches, 16),
        eval_data=eval_data,
        metric=lambda out, lab: float((out.argmax(1) == lab).mean()),
        metric_name="top1",
        output_kind="logits",
    )


def make_ctx(
    task: Task, baseline_onnx: Path, workdir: Path, budget: dict[str, Any] | None = None
) -> StepContext:
    """The pipeline's context on ``task`` with ``baseline_onnx`` as the FP32 baseline."""
    recipe = Recipe(
        name="t",
        task="tests",
        target={"threads": 1},
        budget=budget or {},
        bench={
            "rounds": 2,
            "runs_per_round": 100,
            "warmup": 3,
            "batch_sizes": [1],
            "peak_rss": False,
        },
    )
    base = Candidate("fp32-onnx", "export", None, onnx=baseline_onnx)
    return api.context_for(task, recipe, workdir, baseline=base, cache=workdir.parent / "cache")


def fp32_timed(ctx: StepContext, factor: float = 10.0) -> None:
    """Real timings, with FP32's scaled up ``factor`` times: every candidate is then faster than
    FP32, so which one is chosen depends only on the budget and the candidates' own timings (on
    a CPU where INT8 runs slower than FP32, an AVX2-only one, as on any other). Both ways the
    step times candidates are scaled: the plain comparison and the one that retires candidates
    between rounds (the search's), whose per-round figures are scaled before it reads them."""
    real, real_retiring = ctx.compare_fn, ctx.compare_retiring_fn
    assert real is not None and real_retiring is not None
    fp32 = ctx.baseline.name

    def slowed(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        lat = figures[fp32]["latency_ms"]
        for key, value in lat.items():
            if isinstance(value, (int, float)):
                lat[key] = value * factor
            elif isinstance(value, list):
                lat[key] = [v * factor for v in value]
        return figures

    def retiring(cands: list[Candidate], retire: Any) -> dict[str, dict[str, Any]]:
        def scaled_retire(p50s: dict[str, list[float]]) -> Any:
            return retire({k: [v * factor for v in r] if k == fp32 else r for k, r in p50s.items()})

        return slowed(real_retiring(cands, scaled_retire))

    ctx.compare_fn = lambda cands: slowed(real(cands))
    ctx.compare_retiring_fn = retiring


def encoder_task(encoder_onnx: Path, calib_batches: int = 2) -> Task:
    """The encoder's task: 8-row calibration batches, 16 evaluation rows, fidelity only."""
    return Task(
        name="enc",
        source="tests",
        calibration_data=lambda: batches(text_inputs, calib_batches, 8),
        eval_data=lambda: ((x, None) for x in batches(text_inputs, 1, 16, seed=40)),
        metric=lambda out, lab: float(out.std()) * 0 + 1.0,
        output_kind="embedding",
    )


CRAFTED_ROUNDS = 5


def replayed_compare(per_round: dict[str, list[float]], seen: dict[str, int]) -> Any:
    """A benchmark that replays crafted per-round p50s and asks ``retire`` after each round,
    as slimline.measure.latency.benchmark does."""

    def compare(cands: list[Candidate], retire: Any) -> dict[str, dict[str, Any]]:
        active = [c.name for c in cands]
        done: dict[str, list[float]] = {n: [] for n in active}
        for rnd in range(CRAFTED_ROUNDS):
            for n in active:
                done[n].append(per_round[n][rnd])
            active = [n for n in active if n not in set(retire(done))]
            if len(active) <= 1:
                break
        seen.update({n: len(v) for n, v in done.items()})
        return {
            n: {"latency_ms": summarize_latency([np.full(5, x) for x in v])}
            for n, v in done.items()
        }

    return compare


def crafted_search(
    tmp_path: Path, per_round: dict[str, list[float]], seen: dict[str, int]
) -> Search:
    recipe = recipe_from_dict(
        {"name": "r", "task": "m.onnx", "samples": "s.npz", "bench": {"rounds": CRAFTED_ROUNDS}}
    )
    ctx = StepContext(
        task=Task(
            name="t",
            source="t",
            calibration_data=lambda: [],
            eval_data=lambda: [],
            metric=lambda o, lab: 0.0,
            onnx_path=Path("m.onnx"),
        ),
        recipe=recipe,
        workdir=tmp_path,
        baseline=Candidate("fp32-onnx", "fp32", None),
        reference=Reference(outputs=np.zeros((4, 3), np.float32), labels=None, metric=1.0),
        compare_fn=lambda cs: {},
        compare_retiring_fn=replayed_compare(per_round, seen),
    )
    return Search(ctx, QuantizeConfig(), None, {}, tmp_path, lambda: [])  # type: ignore[arg-type]


def crafted_trial(tmp_path: Path, slug: str) -> Trial:
    spec = QuantSpec(mode="static", calibration=slug)  # type: ignore[arg-type]
    return Trial(spec, PrecisionPlan({}, {}), tmp_path / f"{slug}.onnx")
