"""Which compute layers carry a fake-quant model's error, measured: for each convolution or
linear layer, the score against the FP32 model's outputs when that layer alone runs in float (its
weight and output fake quants off), on calibration rows, and its share of the model's MACs. The
score is the mean cosine, or, where the task declares how its output is judged, that judge's
agreement (e.g. a thresholded map's IoU), cosine breaking ties: :func:`declared_score`.

QAT can then keep the few layers whose float version gains the most in float, within a small
MAC share, and train the rest. On PP-OCRv4's text detector three small early layers (2.6% of
the MACs) carry most of what INT8 loses: the fake-quant model goes from cosine 0.870 to 0.955
with them in float, before any training (``bench/RESULTS-qat-ppocr.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...measure.quality import fidelity
from ...signature import n_rows
from ...tensors import take_samples
from ..finetune import to_tensors
from .held_out import output_arrays

__all__ = [
    "LayerGain",
    "Score",
    "choose_float",
    "cosine_score",
    "declared_score",
    "layer_gains",
    "search_rows",
]

# every output of the student and of the FP32 teacher on the same rows -> higher is closer
Score = Callable[[list[np.ndarray], list[np.ndarray]], float]

# weight of the cosine in a declared score: it only orders layers of equal agreement
COSINE_TIE_WEIGHT = 1e-3


def cosine_score(out: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The lowest mean cosine over the outputs."""
    return min(
        float(fidelity(o, r, False)["cosine_mean"] or 0.0) for o, r in zip(out, ref, strict=True)
    )


def declared_score(agreement: Score) -> Score:
    """The declared ``agreement`` of the outputs, plus :data:`COSINE_TIE_WEIGHT` x their cosine
    (a few rows can tie on agreement)."""

    def score(out: list[np.ndarray], ref: list[np.ndarray]) -> float:
        return agreement(out, ref) + COSINE_TIE_WEIGHT * cosine_score(out, ref)

    return score


@dataclass(frozen=True)
class LayerGain:
    name: str
    score_float: float  # the score (cosine, or declared agreement) with this layer alone in float
    gain: float  # over every layer fake-quantized
    mac_share: float  # of the model's MACs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _outputs(model: Any, rows: dict[str, np.ndarray]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return output_arrays(model(**to_tensors(rows)))


def _compute_layers(student: Any) -> dict[str, list[Any]]:
    """Each module with a weight fake quant, with the fake quants of its output (the FX graph's
    fake-quant nodes that read it)."""
    from torch.ao.quantization import FakeQuantizeBase

    layers: dict[str, list[Any]] = {}
    for name, module in student.named_modules():
        if isinstance(getattr(module, "weight_fake_quant", None), FakeQuantizeBase):
            layers[name] = [module.weight_fake_quant]
    for node in student.graph.nodes:
        if node.op != "call_module" or node.target not in layers:
            continue
        for user in node.users:
            if user.op == "call_module":
                sub = student.get_submodule(str(user.target))
                if isinstance(sub, FakeQuantizeBase):
                    layers[str(node.target)].append(sub)
    return layers


def _macs(student: Any, names: Iterable[str], rows: dict[str, np.ndarray]) -> dict[str, float]:
    """Multiply-accumulates a row of each layer (convolutions and linear layers), by hooks."""
    import torch

    macs: dict[str, float] = {}

    def hook(name: str) -> Any:
        def count(module: Any, args: Any, out: Any) -> None:
            per_out = module.weight[0].numel()  # in / groups x kernel, or in_features
            macs[name] = out.numel() / max(len(out), 1) * per_out

        return count

    handles = [student.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        one = {k: v[:1] for k, v in rows.items()}
        with torch.no_grad():
            student(**to_tensors(one))
    finally:
        for h in handles:
            h.remove()
    return macs


def layer_gains(
    student: Any,
    teacher: Any,
    batches: Iterable[dict[str, np.ndarray]],
    rows: int = 32,
    score: Score = cosine_score,
    progress: bool = False,
) -> list[LayerGain]:
    """The gain of each compute layer of the calibrated fake-quant ``student`` in float, by
    ``score`` against the teacher's outputs on up to ``rows`` rows of ``batches`` (largest gain
    first; ``progress``: a bar over the layers, one model run each). The student's fake quants,
    observers and mode are as they were afterwards."""
    from tqdm.auto import tqdm

    sample = take_samples(batches, rows)
    if not sample:
        return []
    layers = _compute_layers(student)
    fqs = [q for qs in layers.values() for q in qs]
    was_training = student.training
    observing = [bool(q.observer_enabled[0]) for q in fqs]
    enabled = {id(q): bool(q.fake_quant_enabled[0]) for q in fqs}
    student.eval()
    for q in fqs:
        q.disable_observer()
    try:
        ref = _outputs(teacher, sample)

        def measured() -> float:
            return score(_outputs(student, sample), ref)

        base = measured()
        macs = _macs(student, layers, sample)
        total = sum(macs.values()) or 1.0
        out: list[LayerGain] = []
        for name, qs in tqdm(layers.items(), "float-layer search", disable=not progress):
            for q in qs:
                q.disable_fake_quant()
            c = measured()
            for q in qs:
                q.enable_fake_quant(enabled[id(q)])
            out.append(LayerGain(name, c, c - base, macs.get(name, 0.0) / total))
    finally:
        for q, obs in zip(fqs, observing, strict=True):
            q.enable_observer(obs)
        student.train(was_training)
    return sorted(out, key=lambda g: -g.gain)


# fewer rows than this rank layers by a handful of values (on an 800 x 608 layout detector, 2 rows
# ranked them unlike 12 did): the time cap does not go below it
MIN_SEARCH_ROWS = 8


def search_rows(
    student: Any, batches: Iterable[dict[str, np.ndarray]], rows: int, seconds: float | None
) -> dict[str, Any]:
    """The rows :func:`layer_gains` can score on in about ``seconds``: it runs the model once per
    compute layer and twice more, so a row of the student, timed here (its second run on two
    rows), costs that many runs. ``rows`` when it fits or ``seconds`` is None, else fewer, but
    not under :data:`MIN_SEARCH_ROWS` (``over_budget`` then says the estimate still exceeds
    it)."""
    import time

    import torch

    runs = len(_compute_layers(student)) + 2
    if seconds is None or rows <= MIN_SEARCH_ROWS:
        return {"rows": rows, "runs": runs}
    probe = take_samples(batches, 2)
    n = n_rows(probe) if probe else 0
    if not n:
        return {"rows": rows, "runs": runs}
    was_training = student.training
    student.eval()
    try:
        with torch.no_grad():
            student(**to_tensors(probe))  # the first run allocates
            t0 = time.perf_counter()
            student(**to_tensors(probe))
            per_row = (time.perf_counter() - t0) / n
    finally:
        student.train(was_training)
    fit = int(seconds / max(runs * per_row, 1e-9))
    used = max(min(rows, fit), MIN_SEARCH_ROWS)
    out = {
        "rows": used,
        "runs": runs,
        "row_s": round(per_row, 4),
        "estimated_s": round(runs * per_row * used, 1),
    }
    if used < rows:
        out["capped_from"] = rows
    if used > fit:
        out["over_budget"] = True
    return out


def choose_float(gains: list[LayerGain], count: int, max_mac_share: float) -> list[str]:
    """Up to ``count`` layers by measured gain (positive ones only), skipping any that would
    take the float layers past ``max_mac_share`` of the MACs."""
    chosen: list[str] = []
    share = 0.0
    for g in gains:
        if len(chosen) >= count or g.gain <= 0.0:
            break
        if share + g.mac_share <= max_mac_share:
            chosen.append(g.name)
            share += g.mac_share
    return chosen
