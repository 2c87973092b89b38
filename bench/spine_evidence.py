"""Evidence for the spine: first vs repeated run, kill-and-resume, and the CI gate.

    .venv/bin/python bench/spine_evidence.py --recipe minilm --out bench/out/spine

1. a cold run (fresh cache) and its wall time;
2. the same recipe again (warm cache): wall time and that figures were reused;
3. a run killed with SIGKILL mid-way, restarted: it resumes and finishes, nothing partial left;
4. `slimline check`: the cold run against itself, and the same recipe run on 1 thread instead
   of 2 against the cold run; each with the exit status and what `check` printed (whether the
   1-thread run is slower depends on the model and the machine: the report shows what happened).

Writes ``OUT/spine-evidence.md`` and its JSON (and prints it). A part whose run failed, or a
kill whose marker never appeared, is written as "not measured" with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_out import NOT_MEASURED, figure, publish, reproduce_command

SLIMLINE = [sys.executable, "-m", "slimline.cli"]


def run(args: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run([*SLIMLINE, *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, proc


def kill_midway(args: list[str], env: dict[str, str], marker: str) -> tuple[float, bool]:
    """Start ``slimline args``, SIGKILL it when ``marker`` appears on its stderr; (seconds,
    whether the marker appeared: if not, the run ended by itself and nothing was killed)."""
    t0 = time.perf_counter()
    seen = False
    proc = subprocess.Popen(
        [*SLIMLINE, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if marker in line:
            seen = True
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - t0, seen


def _failed(what: str, proc: subprocess.CompletedProcess[str]) -> list[str]:
    tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return [f"- {what}: {NOT_MEASURED} (exit {proc.returncode}: {tail[0]})", ""]


def rows(manifest: Path) -> list[str]:
    m = json.loads(manifest.read_text())
    out = [
        "| candidate | kept | p50 ms | p99 ms | band | thr/s b1 | thr/s b32 | RSS MB | size MB | metric |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["candidates"]:
        lat, tp = c.get("latency_ms") or {}, c.get("throughput") or {}
        band = lat.get("band")
        size = c.get("size_bytes")
        out.append(
            f"| {c['name']} | {'yes' if c['accepted'] else 'no'} | {figure(lat.get('p50'))} | "
            f"{figure(lat.get('p99'))} | "
            f"{f'{band[0]:.3f}-{band[1]:.3f}' if band else NOT_MEASURED} | "
            f"{figure(tp.get('1'), '.0f')} | {figure(tp.get('32'), '.0f')} | "
            f"{figure(c.get('peak_rss_mb'), '.0f')} | "
            f"{figure(None if size is None else size / 1e6, '.1f')} | "
            f"{figure((c.get('metric') or {}).get('value'), '.4f')} |"
        )
    return out


def cold_and_warm(a: argparse.Namespace, env: dict[str, str], doc: dict[str, Any]) -> list[str]:
    report = ["## First run vs repeated run", ""]
    t_cold, p = run(["optimize", a.recipe, "--out", str(a.out / "cold")], env)
    if p.returncode != 0:
        return [*report, *_failed("cold run", p)]
    doc["cold_s"] = t_cold
    t_warm, p2 = run(["optimize", a.recipe, "--out", str(a.out / "warm")], env)
    if p2.returncode != 0:
        return [*report, f"- cold cache: {t_cold:.1f} s", *_failed("warm run", p2)]
    reused = p2.stderr.count("reusing cached result")
    doc.update(warm_s=t_warm, steps_reused=reused)
    return [
        *report,
        f"- cold cache: {t_cold:.1f} s",
        f"- warm cache: {t_warm:.1f} s ({t_cold / t_warm:.1f}x faster; "
        f"{reused} step(s) reused, figures reused: {'reusing cached figures' in p2.stderr})",
        "",
        "Summary rows of the cold run:",
        "",
        *rows(a.out / "cold" / "manifest.json"),
        "",
    ]


def kill_and_resume(a: argparse.Namespace, env: dict[str, str], doc: dict[str, Any]) -> list[str]:
    report = ["## Kill and resume", ""]
    env_k = {**env, "SLIMLINE_CACHE": str(a.out / "cache-kill")}
    t_kill, killed = kill_midway(
        ["optimize", a.recipe, "--out", str(a.out / "killed")], env_k, a.kill_at
    )
    if not killed:
        return [
            *report,
            f"- kill and resume: {NOT_MEASURED} (`{a.kill_at}` never appeared; the run ended "
            f"by itself after {t_kill:.1f} s)",
            "",
        ]
    t_resume, p3 = run(["optimize", a.recipe, "--out", str(a.out / "killed")], env_k)
    leftovers = [
        str(x)
        for x in [*(a.out / "killed").rglob("*"), *(a.out / "cache-kill").rglob("*")]
        if x.name.endswith(".tmp") or x.name.startswith("tmp-")
    ]
    manifest = a.out / "killed" / "manifest.json"
    status = json.loads(manifest.read_text())["status"] if manifest.is_file() else None
    doc.update(kill_s=t_kill, resume_s=t_resume, resume_exit=p3.returncode, leftovers=leftovers)
    return [
        *report,
        f"- SIGKILL at `{a.kill_at}` after {t_kill:.1f} s",
        f"- restarted: exit {p3.returncode} after {t_resume:.1f} s, manifest status "
        f"`{status or NOT_MEASURED}`, steps reused: {p3.stderr.count('reusing cached result')}, "
        f"partial files left: {len(leftovers)}",
        "",
    ]


def ci_gate(a: argparse.Namespace, env: dict[str, str], doc: dict[str, Any]) -> list[str]:
    report = ["## CI gate", ""]
    if "cold_s" not in doc:
        return [*report, f"- CI gate: {NOT_MEASURED} (no cold run to compare against)", ""]
    t_slow, p4 = run(["optimize", a.recipe, "--out", str(a.out / "slowed"), "--threads", "1"], env)
    if p4.returncode != 0:
        return [*report, *_failed("1-thread run", p4)]
    _, same = run(["check", str(a.out / "cold"), "--baseline", str(a.out / "cold")], env)
    _, slow = run(["check", str(a.out / "slowed"), "--baseline", str(a.out / "cold")], env)
    doc.update(check_same_exit=same.returncode, check_slowed_exit=slow.returncode)
    return [
        *report,
        f"- the run against itself: exit {same.returncode}",
        "```",
        same.stdout.strip(),
        "```",
        f"- the same recipe on 1 thread instead of 2 ({figure(t_slow, '.0f')} s): exit "
        f"{slow.returncode}",
        "```",
        slow.stdout.strip(),
        "```",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="minilm")
    ap.add_argument("--out", type=Path, default=Path("bench/out/spine"))
    ap.add_argument("--kill-at", default="step quantize: running")
    a = ap.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    env = {**os.environ, "SLIMLINE_CACHE": str(a.out / "cache"), "HF_HUB_OFFLINE": "1"}
    doc: dict[str, Any] = {"recipe": a.recipe}
    report = [
        f"# Spine evidence: `{a.recipe}`",
        "",
        f"Reproduce: `{reproduce_command('spine_evidence.py', argv)}`",
        "",
        *cold_and_warm(a, env, doc),
        *kill_and_resume(a, env, doc),
        *ci_gate(a, env, doc),
    ]
    # its report quotes the commands' own output, which the JSON does not keep: it goes to
    # bench/out, never into a results file
    publish("\n".join(report), doc, a.out / "spine-evidence.md", "spine_evidence.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
