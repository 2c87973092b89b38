"""Evidence for the spine: first vs repeated run, kill-and-resume, and the CI gate.

    .venv/bin/python bench/spine_evidence.py --recipe minilm --out bench/out/spine

1. a cold run (fresh cache) and its wall time;
2. the same recipe again (warm cache): wall time and that figures were reused;
3. a run killed with SIGKILL mid-way, restarted: it resumes and finishes, nothing partial left;
4. `slimline check`: the cold run against itself passes; a deliberately slowed run (the same
   recipe on 1 thread instead of 2) fails, naming the candidate and the figure.

Writes ``OUT/spine-evidence.md`` (and prints it).
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

SLIMLINE = [sys.executable, "-m", "slimline.cli"]


def run(args: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run([*SLIMLINE, *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, proc


def kill_midway(args: list[str], env: dict[str, str], marker: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*SLIMLINE, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if marker in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - t0


def rows(manifest: Path) -> list[str]:
    m = json.loads(manifest.read_text())
    out = [
        "| candidate | kept | p50 ms | p99 ms | band | thr/s b1 | thr/s b32 | RSS MB | size MB | metric |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in m["candidates"]:
        lat, tp = c.get("latency_ms") or {}, c.get("throughput") or {}
        band = lat.get("band") or [0, 0]
        out.append(
            f"| {c['name']} | {'yes' if c['accepted'] else 'no'} | {lat.get('p50', 0):.3f} | "
            f"{lat.get('p99', 0):.3f} | {band[0]:.3f}-{band[1]:.3f} | {tp.get('1', 0):.0f} | "
            f"{tp.get('32', 0):.0f} | {c.get('peak_rss_mb')} | {(c.get('size_bytes') or 0) / 1e6:.1f} | "
            f"{(c.get('metric') or {}).get('value', float('nan')):.4f} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="minilm")
    ap.add_argument("--out", type=Path, default=Path("bench/out/spine"))
    ap.add_argument("--kill-at", default="step quantize: running")
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    env = {**os.environ, "SLIMLINE_CACHE": str(a.out / "cache"), "HF_HUB_OFFLINE": "1"}
    report = [
        f"# Spine evidence: `{a.recipe}`",
        "",
        f"Reproduce: `.venv/bin/python bench/spine_evidence.py --recipe {a.recipe}`",
        "",
    ]

    t_cold, p = run(["optimize", a.recipe, "--out", str(a.out / "cold")], env)
    assert p.returncode == 0, p.stderr[-3000:]
    t_warm, p2 = run(["optimize", a.recipe, "--out", str(a.out / "warm")], env)
    assert p2.returncode == 0, p2.stderr[-3000:]
    reused = p2.stderr.count("reusing cached result")
    report += [
        "## First run vs repeated run",
        "",
        f"- cold cache: {t_cold:.1f} s",
        f"- warm cache: {t_warm:.1f} s ({t_cold / t_warm:.1f}x faster; "
        f"{reused} step(s) reused, figures reused: {'reusing cached figures' in p2.stderr})",
        "",
        "Summary rows of the cold run:",
        "",
        *rows(a.out / "cold" / "manifest.json"),
        "",
    ]

    env_k = {**env, "SLIMLINE_CACHE": str(a.out / "cache-kill")}
    t_kill = kill_midway(["optimize", a.recipe, "--out", str(a.out / "killed")], env_k, a.kill_at)
    t_resume, p3 = run(["optimize", a.recipe, "--out", str(a.out / "killed")], env_k)
    leftovers = [
        str(x)
        for x in [*(a.out / "killed").rglob("*"), *(a.out / "cache-kill").rglob("*")]
        if x.name.endswith(".tmp") or x.name.startswith("tmp-")
    ]
    status = json.loads((a.out / "killed" / "manifest.json").read_text())["status"]
    report += [
        "## Kill and resume",
        "",
        f"- SIGKILL at `{a.kill_at}` after {t_kill:.1f} s",
        f"- restarted: exit {p3.returncode} after {t_resume:.1f} s, manifest status `{status}`, "
        f"steps reused: {p3.stderr.count('reusing cached result')}, partial files left: {len(leftovers)}",
        "",
    ]

    t_slow, p4 = run(["optimize", a.recipe, "--out", str(a.out / "slowed"), "--threads", "1"], env)
    assert p4.returncode == 0, p4.stderr[-3000:]
    _, same = run(["check", str(a.out / "cold"), "--baseline", str(a.out / "cold")], env)
    _, slow = run(["check", str(a.out / "slowed"), "--baseline", str(a.out / "cold")], env)
    report += [
        "## CI gate",
        "",
        f"- the run against itself: exit {same.returncode}",
        "```",
        same.stdout.strip(),
        "```",
        f"- the same recipe slowed down (1 thread instead of 2, {t_slow:.0f} s): exit {slow.returncode}",
        "```",
        slow.stdout.strip(),
        "```",
        "",
    ]
    text = "\n".join(report)
    (a.out / "spine-evidence.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
