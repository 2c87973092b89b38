"""tune-serving: the search with stub servers of known speed, and one real `slimline serve` run."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.errors import LoadTestError
from slimline.loadtest.stubserver import stub_server
from slimline.loadtest.tune import ServeSetting, TuneConfig, run_variants, tune_serving


def _run_dir(tmp_path: Path, variants: dict[str, bool], selected: str) -> Path:
    run = tmp_path / "run"
    (run / "artifacts").mkdir(parents=True)
    np.savez(run / "samples.npz", x=np.random.default_rng(0).random((16, 4), dtype=np.float32))
    candidates = [{"name": "fp32-torch", "artifact": None, "accepted": True}]
    for name, accepted in variants.items():
        _linear(run / "artifacts" / f"{name}.onnx")
        candidates.append(
            {"name": name, "artifact": f"artifacts/{name}.onnx", "accepted": accepted}
        )
    manifest = {
        "schema": 1,
        "status": "complete",
        "selected": selected,
        "recipe": {"task": "x.onnx", "samples": str(run / "samples.npz")},
        "task": {"name": "lin", "source": "x.onnx"},
        "candidates": candidates,
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def _linear(path: Path) -> None:
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_run_variants_lists_accepted_onnx_candidates(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"fp32-onnx": False, "quantize": True, "prune": False}, "quantize")
    assert sorted(run_variants(run, None)) == ["fp32-onnx", "quantize"]
    with pytest.raises(LoadTestError, match="no accepted ONNX candidate 'prune'"):
        run_variants(run, ["prune"])
    with pytest.raises(LoadTestError, match=r"has no manifest\.json"):
        run_variants(tmp_path, None)


def test_serve_setting_becomes_serve_flags() -> None:
    args = ServeSetting(max_batch_size=16, max_queue_delay_ms=0.5, instances=2, threads=1).args()
    assert args == [
        "--max-batch-size",
        "16",
        "--max-queue-delay-ms",
        "0.5",
        "--instances",
        "2",
        "--threads",
        "1",
    ]


def _stub_starter(delays_ms: dict[str, float], started: list[tuple[str, list[str]]]) -> Any:
    def start(path: Path, args: list[str]) -> AbstractContextManager[str]:
        @contextmanager
        def cm() -> Iterator[str]:
            started.append((path.stem, args))
            with stub_server(
                "--model", path.stem, "--serial", "--delay-ms", str(delays_ms[path.stem])
            ) as url:
                yield url

        return cm()

    return start


def test_search_picks_the_fast_variant_and_drops_the_dominated_one(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"fast": True, "slow": True}, "slow")
    started: list[tuple[str, list[str]]] = []
    cfg = TuneConfig(
        slo_p99_ms=40,
        ort_spinning=[False],
        max_batch_sizes=[8, 16],
        queue_delays_ms=[2.0],
        instances=[1],
        start_rate=40,
        factor=2,
        refine=0,
        step_duration_s=1.0,
        step_warmup_s=0.2,
        max_steps=3,
        max_lag_ms=1000,
        min_requests=10,
    )
    doc = tune_serving(run, cfg, start_server=_stub_starter({"fast": 2.0, "slow": 50.0}, started))
    assert doc["kind"] == "tune-serving" and doc["best"]["variant"] == "fast"
    by = {(r["variant"], r["serve"]["max_batch_size"]): r for r in doc["configs"]}
    slow = by[("slow", 8)]
    # the slow variant (20 rps at most) starts at 0.7 x the fast knee (>= 40) and fails at once
    assert (
        slow["sweep_start_rate"] >= 0.7 * by[("fast", 8)]["knee_rate"] and slow["knee_rate"] is None
    )
    assert len(slow["sweep"]["steps"]) == 1 and "dominated" in slow["note"]
    assert ("slow", 16) not in by and ("fast", 16) in by  # stage 2 only for variants in the race
    assert doc["default"]["variant"] == "slow"  # the run's selected candidate at default settings
    assert (
        doc["serve_command"].startswith("slimline serve ") and "fast.onnx" in doc["serve_command"]
    )
    assert [s for s, _ in started] == ["fast", "slow", "fast"]


def test_tune_serving_against_a_real_server(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"lin": True}, "lin")
    cfg = TuneConfig(
        slo_p99_ms=200,
        ort_spinning=[False],
        max_batch_sizes=[8],
        queue_delays_ms=[2.0],
        instances=[1],
        start_rate=20,
        factor=2,
        refine=0,
        step_duration_s=1.0,
        step_warmup_s=0.3,
        max_steps=2,
        max_configs=1,
        max_lag_ms=1000,
        min_requests=10,
    )
    doc = tune_serving(run, cfg)
    (entry,) = doc["configs"]
    # 20 and 40 rps are far below the server's capacity; a busy test machine may still fail 40.
    # The knee is the *achieved* rate of a 1 s Poisson step: 20 offered can count as 11 answers,
    # so the bound is loose (P(Poisson(20) <= 5) < 1e-4) while still proving answers came back.
    assert entry["knee_rate"] is not None and entry["knee_rate"] > 5, entry["sweep"]["steps"]
    assert entry["sweep"]["knee"]["offered_rate"] >= 20
    assert entry["sweep"]["steps"][-1]["server"]["batch_size_mean"] >= 1.0  # scraped from /metrics
    assert doc["serve_command"] == (
        f"slimline serve {run} --max-batch-size 8 --max-queue-delay-ms 2 --instances 1 --threads "
        f"{entry['serve']['threads'] or ServeSetting().args()[-1]}"
    )


def test_search_stops_when_nothing_meets_the_slo(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"a": True, "b": True}, "a")
    started: list[tuple[str, list[str]]] = []
    cfg = TuneConfig(slo_p99_ms=5, ort_spinning=[False], max_batch_sizes=[4], queue_delays_ms=[2.0], instances=[1],
                     start_rate=40, refine=0, step_duration_s=0.5, step_warmup_s=0.1,
                     max_steps=2, max_lag_ms=1000, min_requests=10)  # fmt: skip
    doc = tune_serving(run, cfg, start_server=_stub_starter({"a": 20.0, "b": 20.0}, started))
    assert doc["best"] is None and "no configuration met p99 <= 5 ms" in doc["note"]
    assert [s for s, _ in started] == ["a", "b"]  # one failed step each, nothing finer


def _args_starter(delay_ms: Callable[[list[str]], float], started: list[list[str]]) -> Any:
    """A one-at-a-time stub server whose delay depends on the serve flags it is started with."""

    def start(path: Path, args: list[str]) -> AbstractContextManager[str]:
        @contextmanager
        def cm() -> Iterator[str]:
            started.append(args)
            with stub_server(
                "--model", path.stem, "--serial", "--delay-ms", str(delay_ms(args))
            ) as url:
                yield url

        return cm()

    return start


def test_spinning_is_tried_per_variant_and_carried_into_the_refinement(tmp_path: Path) -> None:
    """A server that is only fast with spin-waiting (a many-op model on dedicated cores): the
    first stage tries both, later stages refine the spinning setting, the command carries it."""
    run = _run_dir(tmp_path, {"enc": True}, "enc")
    started: list[list[str]] = []
    start = _args_starter(lambda args: 2.0 if "--ort-spinning" in args else 50.0, started)
    cfg = TuneConfig(slo_p99_ms=40, max_batch_sizes=[16], queue_delays_ms=[2.0], instances=[1],
                     start_rate=40, factor=2, refine=0, step_duration_s=0.6, step_warmup_s=0.1,
                     max_steps=2, max_lag_ms=1000, min_requests=10)  # fmt: skip
    doc = tune_serving(run, cfg, start_server=start)
    spins = [("--ort-spinning" in a) for a in started]
    assert spins[:2] == [False, True] and all(spins[2:]), started  # refined with spinning on
    assert doc["best"]["serve"]["ort_spinning"] is True
    assert doc["default"]["knee_rate"] is None  # 50 ms per request fails a 40 ms SLO at once
    assert doc["serve_command"].endswith("--ort-spinning")


def test_queue_delay_is_not_searched_when_the_best_batch_size_is_one(tmp_path: Path) -> None:
    """At max_batch_size 1 a request is dispatched on arrival: delays differ only by noise, so
    stage 3 must not spend servers on them (only the instance counts are tried)."""
    run = _run_dir(tmp_path, {"enc": True}, "enc")
    started: list[list[str]] = []

    def delay(args: list[str]) -> float:  # serial at 10 ms: under 100 rps
        return 2.0 if args[args.index("--max-batch-size") + 1] == "1" else 10.0

    start = _args_starter(delay, started)
    cfg = TuneConfig(slo_p99_ms=40, ort_spinning=[False], max_batch_sizes=[1, 8],
                     queue_delays_ms=[0.5, 5.0], instances=[1, 2], start_rate=20, factor=2,
                     refine=0, step_duration_s=0.6, step_warmup_s=0.1, max_steps=4,
                     max_lag_ms=1000, min_requests=10)  # fmt: skip
    doc = tune_serving(run, cfg, start_server=start)
    assert doc["best"]["serve"]["max_batch_size"] == 1
    stage3 = [r["serve"] for r in doc["configs"] if r["stage"] == "delay and instances"]
    assert stage3 and {s["max_queue_delay_ms"] for s in stage3} == {2.0}  # the base's delay
    assert {s["instances"] for s in stage3} == {2}  # instances=1 at delay 2 was already measured
    assert len(started) == 3  # default, batch 1, batch 1 x 2 instances


def test_a_tie_within_the_tolerance_goes_to_the_simplest_configuration(tmp_path: Path) -> None:
    """Every configuration serves at the same speed (2 ms a request under a 400 ms SLO: wide, so
    that a loaded test machine cannot push a configuration past it), so their knees differ by
    sampling noise only: the pick must be the simplest one measured, not the luckiest, and the
    fastest is still reported beside it."""
    run = _run_dir(tmp_path, {"enc": True}, "enc")
    started: list[list[str]] = []
    start = _args_starter(lambda args: 2.0, started)
    cfg = TuneConfig(slo_p99_ms=400, ort_spinning=[False, True], max_batch_sizes=[1, 8],
                     queue_delays_ms=[0.5], instances=[1, 2], start_rate=20, factor=2,
                     refine=0, step_duration_s=0.6, step_warmup_s=0.1, max_steps=2,
                     max_lag_ms=1000, min_requests=10, tie_tolerance=0.5)  # fmt: skip
    doc = tune_serving(run, cfg, start_server=start)
    configs = doc["configs"]
    assert len(configs) >= 4 and all(r["knee_rate"] for r in configs)
    best = doc["best"]["serve"]
    assert best["instances"] == 1 and best["ort_spinning"] is False
    for r in configs:  # no simpler single-instance, non-spinning configuration was passed over
        s = r["serve"]
        if s["instances"] == 1 and not s["ort_spinning"]:
            assert (best["max_batch_size"], best["max_queue_delay_ms"]) <= (
                s["max_batch_size"],
                s["max_queue_delay_ms"],
            )
    assert doc["fastest"]["knee_rate"] == max(r["knee_rate"] for r in configs)
    assert ("tie_note" in doc) == (doc["fastest"] != doc["best"])


def test_no_tie_tolerance_picks_the_fastest_knee(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"enc": True}, "enc")
    start = _args_starter(lambda args: 2.0, [])  # 2 ms under a wide SLO: every config has a knee
    cfg = TuneConfig(slo_p99_ms=400, ort_spinning=[False, True], max_batch_sizes=[8],
                     queue_delays_ms=[2.0], instances=[1], start_rate=20, factor=2, refine=0,
                     step_duration_s=0.6, step_warmup_s=0.1, max_steps=2, max_lag_ms=1000,
                     min_requests=10, tie_tolerance=0)  # fmt: skip
    doc = tune_serving(run, cfg, start_server=start)
    assert doc["best"] == doc["fastest"] and "tie_note" not in doc
    assert doc["best"]["knee_rate"] == max(r["knee_rate"] for r in doc["configs"])
