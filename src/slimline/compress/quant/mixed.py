"""Mixed precision: when no candidate is both faster than FP32 and within budget, keep the
worst nodes of the fastest one in float, ranked by layer-wise error (and, for the first
``impact_nodes``, by measured output impact), bisecting over how many until the budget is met.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from ...candidate import Candidate
from ...context import StepContext
from ...errors import error_text, is_user_error
from ...measure.quality import Quality
from .impact import EMBEDDINGS, output_impact, rank_by_impact
from .plan import MIXED
from .trial import Search, Trial

__all__ = ["budget_score", "mixed_from_fastest", "mixed_precision"]

log = logging.getLogger("slimline.quantize")


def mixed_from_fastest(s: Search) -> Trial | None:
    """Mixed precision from the fastest candidate that is faster than FP32 (it only costs speed)."""
    fast = sorted((t for t in s.usable() if s.faster(t)), key=lambda t: t.p50())
    if not fast:
        s.mixed_trace.append({"skipped": "no candidate is faster than FP32, nothing to trade"})
        return None
    try:
        best = mixed_precision(s, fast[0])
    except Exception as err:  # the layer-wise ranking ran the model node by node, and failed
        if is_user_error(err):
            raise
        s.mixed_trace.append({"skipped": f"layer-wise error failed: {error_text(err)}"})
        return None
    if best is not None and best.budget_ok:
        s.measure([best])
    elif best is not None:  # over budget: it cannot be chosen for speed, so it is not timed
        s.mixed_trace.append({"not_timed": f"{best.name} is over budget: {best.budget_reason}"})
    return best


def mixed_precision(s: Search, base: Trial) -> Trial | None:
    """Keep the worst nodes of ``base``'s ranking in float, bisecting over how many, until the
    budget is met (at most ``max_float_share`` of them). Returns the last probe that met it, or
    the largest probe when none did."""
    rows = s.layer_errors(base)
    ranking = [r["node"] for r in rows if r["sqnr_db"] is not None]
    if not ranking:
        return None
    hi = max(1, int(s.cfg.max_float_share * len(ranking)))
    probes: dict[int, Trial] = {}

    def probe(k: int) -> Trial:
        nodes = [n for n in ranking[:k] if n != EMBEDDINGS]
        spec = replace(base.spec, embeddings=False) if EMBEDDINGS in ranking[:k] else base.spec
        plan = base.plan.with_float(nodes, MIXED)
        trial = s.judge(s.build(spec, plan, f"-mixed{k}"))
        probes[k] = trial
        s.mixed_trace.append(
            {
                "float_nodes": k,
                "ok": trial.budget_ok,
                "reason": trial.budget_reason,
                "fidelity": trial.quality.fidelity_dict() if trial.quality else None,
                **({"screened": trial.screened} if trial.screened else {}),
            }
        )
        return trial

    if s.cfg.impact_nodes > 0 and not probe(hi).budget_ok:
        # the float share allowed cannot reach the budget in layer-wise order: measuring each
        # node's output impact (one evaluation per node) would only reorder a lost cause
        s.mixed_trace.append(
            {
                "result": f"out of reach: even the {hi} worst-ranked of {len(ranking)} nodes "
                f"(max_float_share {s.cfg.max_float_share}) in float miss the budget; "
                "output impact not measured",
            }
        )
        return probes[hi]
    ranking = _impact_order(s, base, ranking)
    probes.clear()

    if not probe(hi).budget_ok:
        s.mixed_trace.append({"result": f"even {hi} nodes in float miss the budget"})
        return probes[hi]
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid).budget_ok:
            hi = mid
        else:
            lo = mid
    best = probes[hi]
    s.mixed_trace.append(
        {
            "result": f"{hi} of {len(ranking)} ranked nodes kept in float",
            "from": base.spec.label,
            "float_nodes_list": ranking[:hi],
        }
    )
    return best


def _impact_order(s: Search, base: Trial, ranking: list[str]) -> list[str]:
    """``ranking`` re-ordered by measured gain in the budget's cosine per cost (:mod:`.impact`)
    over its first ``impact_nodes`` nodes (and the embedding tables of a dynamic candidate that
    stores them in 8 bits); unchanged when ``impact_nodes`` is 0."""
    limit = s.cfg.impact_nodes
    if limit <= 0:
        return ranking
    measured = ranking[:limit] + ([EMBEDDINGS] if base.spec.embeddings else [])

    def progress(done: int, total: int) -> None:
        log.info("quantize: mixed precision: output impact %d/%d", done, total)

    try:
        with s.timed("impact"):
            impacts = output_impact(
                s.prepared.path,
                base.spec,
                base.plan.float_nodes,
                measured,
                lambda path: _budget_score(s, path),
                s.caches,
                "size" if s.objective == "size" else "latency",
                progress,
                budget_score(base.quality, s.ctx) if base.quality and not base.screened else None,
            )
    except Exception as err:  # a probe the quantizer or runtime refused: rank as before
        if is_user_error(err):
            raise
        s.mixed_trace.append({"impact_skipped": error_text(err)})
        return ranking
    order = rank_by_impact(ranking, impacts)
    s.mixed_trace.append(
        {
            "impact": [i.to_dict() for i in sorted(impacts, key=lambda i: -i.score)],
            "base_score": budget_score(base.quality, s.ctx) if base.quality else None,
            "order": order[: len(measured)],
        }
    )
    return order


def _budget_score(s: Search, path: Path) -> float:
    """:func:`budget_score` of the model at ``path``."""
    probe = Candidate(name="quantize:impact-probe", step="quantize", parent=None, onnx=path)
    return budget_score(s.ctx.evaluate(probe), s.ctx)


def budget_score(q: Quality, ctx: StepContext) -> float:
    """What the budget judges, as one number that grows toward FP32: the mean cosine to the
    FP32 outputs; with outputs declared by kind, the smaller margin of the declared agreement
    over ``min_agreement`` and of the other outputs' cosine over ``min_cosine``."""
    if q.agreement is None:
        return float(q.cosine_mean)
    b = ctx.recipe.budget
    margins = [q.agreement - b.min_agreement]
    if q.cosine_judged is not None:
        margins.append(q.cosine_judged - b.min_cosine)
    return float(min(margins))
