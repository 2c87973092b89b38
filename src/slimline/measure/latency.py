"""Latency and throughput, measured interleaved so that ratios hold on a noisy machine.

Candidates run in rounds, A B C, then B C A, then C A B, ... (the order rotates so none is
always first after the others). Each figure is the median over rounds, with the min-max band of
the per-round values, so a reader can tell a real difference from noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
from tqdm import tqdm

from ..candidate import Candidate
from ..errors import CandidateError, error_text, is_user_error
from ..module_guard import torch_threads
from ..recipe import BenchConfig
from ..runtimes import pair_name
from ..signature import Signature, tile_rows
from ..task import Inputs
from .runners import Runner, make_runner, runs_to_fill

__all__ = [
    "DECISIVE_MARGIN",
    "DECISIVE_ROUNDS",
    "SIGN_TEST_ALPHA",
    "Retire",
    "Until",
    "benchmark",
    "cannot_be_faster",
    "decision_runs",
    "decisively_faster",
    "fixed_batch_note",
    "median_cannot_win",
    "paired_speedup",
    "pool_rounds",
    "round_drift",
    "settled_verdict",
    "speed_verdict",
    "summarize_latency",
    "tile_batch",
]

# A candidate counts as measurably faster when its bands sit apart or, paired by round, it wins
# more rounds than chance would give at this level (5 of 5 rounds; 12 of 15).
SIGN_TEST_ALPHA = 0.05

_PCTS = {"p50": 50.0, "p95": 95.0, "p99": 99.0}
# a decision benchmark (candidate vs parent, a search's candidates vs FP32; never the final
# figures) runs about this long per candidate per round, at least DECISION_MIN_RUNS runs: a
# round's p50 decides, not its tail, and on an AVX2-only CPU a 100 ms detector's 40 runs per
# round made a third of its wall time (bench/RESULTS-zoo-avx2.md)
DECISION_ROUND_S = 1.0
DECISION_MIN_RUNS = 15
# The final figures (a report, never a decision) run ``runs_per_round`` per round, or fewer
# where a round of the slowest model would take over REPORT_ROUND_S, but never fewer than
# REPORT_MIN_RUNS over all rounds (the README's floor for p99): a 45 ms model then runs 40 per
# round, not 60, which on an AVX2-only CPU was 4.5 s of each timed pair of the main job.
REPORT_ROUND_S = 1.5
REPORT_MIN_RUNS = 200

# After each round: the per-round p50s so far, by name; True stops the benchmark there.
Until = Callable[[dict[str, list[float]]], bool]

# After each round: the per-round p50s so far, by name; the names that need no more rounds
# (their verdict is settled). They are left out of later rounds; when one name is left, it stops.
Retire = Callable[[dict[str, list[float]]], Collection[str]]

# One model's p50 moving by more than this between rounds of one benchmark is the machine, not
# the model: seen on a 2-core VM whose batch-1 speed switches between modes 1.55x apart.
DRIFT_SPREAD = 1.25


def tile_batch(sample: Inputs, batch: int, sig: Signature | None = None) -> Inputs:
    """A batch of exactly ``batch`` rows (along each input's batch axis), repeating
    ``sample``'s rows if it has fewer."""
    return tile_rows(sample, batch, sig)


def fixed_batch_note(sig: Signature | None, batch_sizes: list[int]) -> dict[str, str]:
    """Batch sizes whose throughput is not measured, with why: the model takes fewer rows."""
    if sig is None:
        return {}
    return {
        str(b): f"the model takes at most {sig.max_batch} row(s) per call (a fixed batch)"
        for b in batch_sizes
        if not sig.allows(b)
    }


def summarize_latency(rounds: list[np.ndarray]) -> dict[str, Any]:
    """Median over rounds of each per-round percentile, with bands; samples in ms."""
    per_round = {k: [float(np.percentile(r, q)) for r in rounds] for k, q in _PCTS.items()}
    per_round["mean"] = [float(r.mean()) for r in rounds]
    out: dict[str, Any] = {k: float(np.median(v)) for k, v in per_round.items()}
    out["band"] = [min(per_round["p50"]), max(per_round["p50"])]
    out["per_round_p50"] = per_round["p50"]
    out["bands"] = {k: [min(v), max(v)] for k, v in per_round.items()}
    out["runs"] = int(sum(len(r) for r in rounds))
    out["rounds"] = len(rounds)
    return out


def paired_speedup(parent: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """How much faster ``cand`` is than ``parent``, round by round.

    Both are ``summarize_latency`` results of the same interleaved benchmark, so round ``i`` of
    each ran minutes apart at most, on the same machine state. A drifting VM moves both sides of
    a round together: the per-round ratio cancels it, where the bands of per-round medians (the
    unpaired view) only widen. ``ratio`` is the median per-round ratio; ``p_value`` is the
    one-sided sign test that the candidate is faster in more rounds than chance would give.
    """
    from scipy.stats import binomtest

    p, c = parent["per_round_p50"], cand["per_round_p50"]
    if len(p) != len(c) or not p:
        raise ValueError(
            f"paired comparison needs the same rounds on both sides, got {len(p)} and {len(c)}"
        )
    ratios = [ci / pi for ci, pi in zip(c, p, strict=True)]
    faster = sum(r < 1.0 for r in ratios)
    return {
        "ratio": float(np.median(ratios)),
        "ratios": ratios,
        "faster_rounds": faster,
        "rounds": len(ratios),
        "p_value": float(binomtest(faster, len(ratios), 0.5, alternative="greater").pvalue),
    }


def speed_verdict(
    parent: dict[str, Any], cand: dict[str, Any], min_gain: float
) -> tuple[str, dict[str, Any]]:
    """``faster``, ``not faster`` or ``inconclusive`` for two latencies of one interleaved run.

    Faster: the median per-round ratio wins by ``min_gain`` and the win is real, either because
    the bands of per-round medians are apart (every round of the candidate beat every round of
    the parent) or because the paired sign test says so. Inconclusive: the gain is there at the
    median but neither test holds; measuring more rounds can settle it.
    """
    pair = paired_speedup(parent, cand)
    if pair["ratio"] > 1.0 - min_gain:
        return "not faster", pair
    apart = cand["band"][1] < parent["band"][0]
    if apart or pair["p_value"] <= SIGN_TEST_ALPHA:
        return "faster", pair
    return "inconclusive", pair


def cannot_be_faster(
    parent_rounds: Sequence[float], cand_rounds: Sequence[float], rounds: int, min_gain: float
) -> bool:
    """Whether :func:`speed_verdict` over ``rounds`` rounds must say ``not faster`` whatever the
    rounds not yet run give: more than half of all ``rounds`` per-round ratios already miss the
    gain, so their median does too. Stopping then changes no verdict; it only skips rounds."""
    misses = sum(c / p > 1.0 - min_gain for p, c in zip(parent_rounds, cand_rounds, strict=True))
    return misses > rounds // 2


def settled_verdict(
    parent_rounds: Sequence[float],
    cand_rounds: Sequence[float],
    rounds: int,
    min_gain: float,
    alpha: float = SIGN_TEST_ALPHA,
) -> str | None:
    """The verdict :func:`speed_verdict` must give over ``rounds`` paired rounds whatever the
    rounds not yet run give, or None while it can still go either way. ``not faster``: more than
    half of the ``rounds`` per-round ratios already miss the gain (:func:`cannot_be_faster`).
    ``faster``: more than half already reach it (so the median does), and the rounds already
    faster pass the sign test even if every round still to run were slower. Stopping on either
    changes no verdict; the figures then cover the rounds run."""
    if cannot_be_faster(parent_rounds, cand_rounds, rounds, min_gain):
        return "not faster"
    ratios = [c / p for p, c in zip(parent_rounds, cand_rounds, strict=True)]
    hits = sum(r <= 1.0 - min_gain for r in ratios)
    faster = sum(r < 1.0 for r in ratios)
    if hits > rounds // 2 and len(ratios) < rounds:
        from scipy.stats import binomtest

        if float(binomtest(faster, rounds, 0.5, alternative="greater").pvalue) <= alpha:
            return "faster"
    return None


# A comparison may stop as "faster" before its last round when, after at least this many
# rounds, every round's ratio is below this share of the gain threshold and the bands already
# sit apart: a candidate at 0.46x in each round needs no fourth one to be called faster. A
# close race (any round near the threshold) runs every round.
DECISIVE_ROUNDS = 3
DECISIVE_MARGIN = 0.8


def decisively_faster(
    parent_rounds: Sequence[float], cand_rounds: Sequence[float], rounds: int, min_gain: float
) -> bool:
    """Whether a comparison can stop as ``faster`` before its last round: at least
    :data:`DECISIVE_ROUNDS` rounds run, each with the candidate at most :data:`DECISIVE_MARGIN`
    times ``1 - min_gain`` of the parent, and the candidate's slowest round faster than the
    parent's fastest. :func:`speed_verdict` on the rounds run then says ``faster`` (the bands are
    apart); unlike :func:`settled_verdict` this does not cover what later rounds could have
    shown, so it is kept to wins far beyond the threshold."""
    k = len(cand_rounds)
    if k < DECISIVE_ROUNDS or k >= rounds or len(parent_rounds) != k:
        return False
    limit = DECISIVE_MARGIN * (1.0 - min_gain)
    ratios = [c / p for p, c in zip(parent_rounds, cand_rounds, strict=True)]
    return max(ratios) <= limit and max(cand_rounds) < min(parent_rounds)


def median_cannot_win(
    base_rounds: Sequence[float], cand_rounds: Sequence[float], rounds: int, min_gain: float
) -> bool:
    """Whether the median of ``cand_rounds`` must stay at or above ``1 - min_gain`` times the
    median of ``base_rounds`` once both have ``rounds`` rounds, whatever the rounds still to run
    give: even if the candidate's were all instant and the base's endless. The unpaired test of a
    quantize search's candidate against FP32 (its median wins by ``min_gain``) then fails; a
    candidate stopped here has a median over fewer rounds that is no lower than that bound, so
    the test still fails on it."""
    k, m = len(cand_rounds), len(base_rounds)
    if k == 0 or k >= rounds or m < k:
        return False
    low = float(np.median([*cand_rounds, *([0.0] * (rounds - k))]))
    high = float(np.median([*base_rounds, *([np.inf] * max(0, rounds - m))]))
    return bool(np.isfinite(high) and low >= (1.0 - min_gain) * high)


def round_drift(lat: dict[str, Any]) -> float | None:
    """How far one candidate's per-round p50 moved within a benchmark: slowest / fastest round.

    The same model on the same input should repeat within a few percent; a spread beyond
    :data:`DRIFT_SPREAD` means the machine changed speed during the benchmark. Ratios paired by
    round survive a drift that moves both sides of a round; they do not survive a change in the
    middle of a round, and with few rounds one or two such rounds move the median.
    """
    rounds = lat.get("per_round_p50") or []
    if len(rounds) < 2 or min(rounds) <= 0:
        return None
    return float(max(rounds) / min(rounds))


def pool_rounds(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two ``summarize_latency`` results of the same candidate as one, over all their rounds.

    Percentiles other than p50 come from ``second``, the later and longer measurement."""
    p50 = [*first["per_round_p50"], *second["per_round_p50"]]
    return {
        **second,
        "p50": float(np.median(p50)),
        "band": [min(p50), max(p50)],
        "per_round_p50": p50,
        "rounds": len(p50),
        "runs": first["runs"] + second["runs"],
    }


def _time_runs(runner: Runner, sample: Inputs, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Wall time and process CPU time of each run, in ms.

    CPU time (all threads of this process) is the figure that other load on the machine does
    not inflate: on an oversubscribed machine a long run is preempted more often than a short
    one, so wall-time ratios exaggerate speed-ups; CPU-time ratios don't (for a multi-threaded
    session they include the worker threads' spin-waits, so they are an upper bound).
    """
    wall, cpu = np.empty(n), np.empty(n)
    for i in range(n):
        c0, t0 = time.process_time_ns(), time.perf_counter_ns()
        runner.run(sample)
        wall[i] = (time.perf_counter_ns() - t0) / 1e6
        cpu[i] = (time.process_time_ns() - c0) / 1e6
    return wall, cpu


def _summarize_cpu(rounds: list[np.ndarray]) -> dict[str, Any]:
    p50 = [float(np.median(r)) for r in rounds]
    return {
        "p50": float(np.median(p50)),
        "band": [min(p50), max(p50)],
        "mean": float(np.median([r.mean() for r in rounds])),
    }


def _throughput(
    runner: Runner, batch: Inputs, size: int, min_seconds: float, warm: bool = True
) -> float:
    """Rows per second of ``runner`` on ``batch``: whole calls until ``min_seconds`` have passed.
    ``warm``: one untimed call first, the first time this runner meets this batch size (its
    allocations for the shape); later rounds reuse them, and a long call is one sample: at
    batch 32 of a 40 ms model a call takes over a second, and extra calls there only cost time."""
    if warm:
        runner.run(batch)
    done, t0 = 0, time.perf_counter()
    while True:
        runner.run(batch)
        done += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return done * size / elapsed


def benchmark(
    cands: list[Candidate],
    sample: Inputs,
    bench: BenchConfig,
    threads: int,
    *,
    throughput: bool = True,
    desc: str = "benchmark",
    signature: Signature | None = None,
    runtimes: Sequence[str] = ("onnxruntime",),
    pairs: Collection[str] | None = None,
    until: Until | None = None,
    retire: Retire | None = None,
    decision: bool = False,
) -> dict[str, dict[str, Any]]:
    """Latency at batch 1 (and throughput per batch size the model allows) of each candidate,
    interleaved.

    With one runtime the results are keyed by candidate name. With several, every ONNX
    candidate runs on each (interleaved in the same rounds) and is keyed by
    :func:`~slimline.runtimes.pair_name`; a pair that runtime cannot load gets ``{"failed":
    message}`` and the other pairs are measured. ``pairs`` (pair names) limits a benchmark on
    several runtimes to those pairs. ``until`` may stop it after a whole round (every result then
    has the rounds run so far); ``retire`` may leave some out of the later rounds (each result's
    ``latency_ms.rounds`` says how many it ran). ``decision``: a benchmark that decides
    (:func:`decision_runs` per round), not one whose figures are reported."""
    torch_runs = any(c.onnx is None for c in cands)
    # pinned once for the whole benchmark, so that a torch runner changes nothing per call
    with torch_threads(threads) if torch_runs else nullcontext():
        return _benchmark(
            cands,
            sample,
            bench,
            threads,
            throughput,
            desc,
            signature,
            runtimes,
            pairs,
            (until, retire),
            decision,
        )


def _benchmark(
    cands: list[Candidate],
    sample: Inputs,
    bench: BenchConfig,
    threads: int,
    throughput: bool,
    desc: str,
    signature: Signature | None,
    runtimes: Sequence[str] = ("onnxruntime",),
    pairs: Collection[str] | None = None,
    stops: tuple[Until | None, Retire | None] = (None, None),
    decision: bool = False,
) -> dict[str, dict[str, Any]]:
    until, retire = stops
    keyed, failed = _runners(cands, threads, signature, runtimes, pairs)
    one = tile_batch(sample, 1, signature)
    keyed, took = _warmed_up(keyed, one, bench.warmup, failed if len(runtimes) > 1 else None)
    if not keyed:
        return failed
    names, runners = [k for k, _ in keyed], [r for _, r in keyed]
    runs = (
        decision_runs(keyed, one, bench.runs_per_round, took)
        if decision
        else report_runs(keyed, one, bench, took)
    )
    sizes = [b for b in bench.batch_sizes if signature is None or signature.allows(b)]
    batches = {b: tile_batch(sample, b, signature) for b in sizes} if throughput else {}
    not_applicable = fixed_batch_note(signature, bench.batch_sizes) if throughput else {}
    lat: list[list[np.ndarray]] = [[] for _ in runners]
    cpu: list[list[np.ndarray]] = [[] for _ in runners]
    tput: list[dict[int, list[float]]] = [{b: [] for b in batches} for _ in runners]
    tput_rounds = throughput_round_indices(bench.rounds, bench.throughput_rounds)
    steps = bench.rounds * len(runners)
    active = set(range(len(runners)))
    with tqdm(total=steps, desc=desc, unit="run-set", leave=False, disable=None) as bar:
        for rnd in range(bench.rounds):
            for j in range(len(runners)):
                i = (j + rnd) % len(runners)
                if i not in active:
                    continue
                wall, used = _time_runs(runners[i], one, runs)
                lat[i].append(wall)
                cpu[i].append(used)
                sizes_now = batches.items() if rnd in tput_rounds else ()
                for b, x in sizes_now:
                    first = not tput[i][b]
                    tput[i][b].append(
                        _throughput(runners[i], x, b, bench.throughput_min_seconds, first)
                    )
                bar.update(1)
            if until is not None and until(_round_p50s(names, lat)):
                break
            if retire is not None:
                done = set(retire(_round_p50s(names, lat)))
                active -= {i for i, n in enumerate(names) if n in done}
                if len(active) <= 1:
                    break
    results: dict[str, dict[str, Any]] = dict(failed)
    for name, rounds, cpu_rounds, tp in zip(names, lat, cpu, tput, strict=True):
        entry: dict[str, Any] = {
            "latency_ms": summarize_latency(rounds),
            "cpu_ms": _summarize_cpu(cpu_rounds),
            "latency_samples_ms": np.round(np.concatenate(rounds), 4).tolist(),
        }
        tp = {b: v for b, v in tp.items() if v}  # a retired candidate may have none
        if tp:
            entry["throughput"] = {str(b): float(np.median(v)) for b, v in tp.items()}
            entry["throughput_band"] = {str(b): [min(v), max(v)] for b, v in tp.items()}
        if not_applicable:
            entry["throughput_not_applicable"] = not_applicable
        results[name] = entry
    return results


def _warmed_up(
    keyed: list[tuple[str, Runner]],
    one: Inputs,
    warmup: int,
    failed: dict[str, dict[str, Any]] | None,
) -> tuple[list[tuple[str, Runner]], dict[str, float]]:
    """The pairs after ``warmup`` runs each, and the faster of each pair's last two warm-up runs
    in seconds (where it had two). With several runtimes (``failed`` given), a pair that loaded
    but fails to run (a runtime's own error, a missing output) gets ``{"failed": why}`` and the
    others are measured; a user's error, or any failure with one runtime, raises as before."""
    kept: list[tuple[str, Runner]] = []
    took: dict[str, float] = {}
    for key, r in keyed:
        try:
            for i in range(warmup):
                t0 = time.perf_counter()
                r.run(one)
                if i >= warmup - 2 and warmup >= 2:
                    took[key] = min(took.get(key, np.inf), time.perf_counter() - t0)
        except Exception as err:
            if failed is None or is_user_error(err):
                raise
            failed[key] = {"failed": f"it loaded but does not run: {error_text(err)}"}
            took.pop(key, None)
            continue
        kept.append((key, r))
    return kept, took


def decision_runs(
    keyed: list[tuple[str, Runner]],
    one: Inputs,
    runs_per_round: int,
    took: dict[str, float] | None = None,
) -> int:
    """Runs per round of a decision benchmark: ``runs_per_round``, or fewer where the slowest
    runner's run (the faster of its last two warm-up runs, ``took`` in seconds, or of two timed
    here where the warm-up had fewer) makes a round of it longer than :data:`DECISION_ROUND_S`,
    but not under :data:`DECISION_MIN_RUNS`."""
    slowest = _slowest_run(keyed, one, took)
    return runs_to_fill(slowest, DECISION_ROUND_S, DECISION_MIN_RUNS, runs_per_round)


def report_runs(
    keyed: list[tuple[str, Runner]],
    one: Inputs,
    bench: BenchConfig,
    took: dict[str, float] | None = None,
) -> int:
    """Runs per round of a benchmark whose figures are reported: ``bench.runs_per_round``, or
    fewer where the slowest runner makes a round longer than :data:`REPORT_ROUND_S`, but not
    under :data:`REPORT_MIN_RUNS` over ``bench.rounds`` rounds."""
    floor = -(-REPORT_MIN_RUNS // bench.rounds)
    slowest = _slowest_run(keyed, one, took)
    return runs_to_fill(slowest, REPORT_ROUND_S, floor, bench.runs_per_round)


def _slowest_run(
    keyed: list[tuple[str, Runner]], one: Inputs, took: dict[str, float] | None
) -> float:
    """Seconds per run of the slowest runner: the faster of its last two warm-up runs
    (``took``), or of two timed here where the warm-up had fewer."""
    took = took or {}
    return max(
        took[k] if k in took else float(np.min(_time_runs(r, one, 2)[0])) / 1e3 for k, r in keyed
    )


def throughput_round_indices(rounds: int, wanted: int) -> frozenset[int]:
    """Which of ``rounds`` rounds also measure throughput: ``wanted`` of them, spread evenly from
    the first to the last, so that throughput sees the same drift of the machine that latency
    does. Throughput at batch 8 and 32 takes most of a round's time and is reported, never
    judged, so fewer rounds of it cost no decision."""
    if wanted >= rounds:
        return frozenset(range(rounds))
    return frozenset(round(float(x)) for x in np.linspace(0, rounds - 1, wanted))


def _round_p50s(names: list[str], lat: list[list[np.ndarray]]) -> dict[str, list[float]]:
    return {
        n: [float(np.percentile(r, 50.0)) for r in rounds]
        for n, rounds in zip(names, lat, strict=True)
    }


def _runners(
    cands: list[Candidate],
    threads: int,
    sig: Signature | None,
    runtimes: Sequence[str],
    pairs: Collection[str] | None = None,
) -> tuple[list[tuple[str, Runner]], dict[str, dict[str, Any]]]:
    """(key, runner) per measured pair (only those in ``pairs`` when given); with several
    runtimes, ``{"failed": why}`` per pair a runtime cannot load (with one runtime a load
    failure raises, as before)."""
    if len(runtimes) == 1:
        return [(c.name, make_runner(c, threads, sig, runtimes[0])) for c in cands], {}
    keyed: list[tuple[str, Runner]] = []
    failed: dict[str, dict[str, Any]] = {}
    for c in cands:
        for rt in runtimes if c.onnx is not None else ["torch"]:
            key = pair_name(rt, c.name)
            if pairs is not None and key not in pairs:
                continue
            try:
                keyed.append((key, make_runner(c, threads, sig, rt)))
            except CandidateError as err:
                failed[key] = {"failed": str(err)}
    return keyed, failed
