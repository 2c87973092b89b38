"""Wall time of one ``slimline optimize`` command from a cold cache, the load on the machine
around and during it, and where the time went (the manifest's ``phase_seconds``).

The command runs as the user runs it (the ``slimline`` console script, under ``/usr/bin/time
-v`` where the system has it), with ``SLIMLINE_CACHE`` pointing at an empty folder. The result
is a markdown section; ``--into FILE`` puts it into a results file between its own markers
(replacing an earlier one), so ``bench/runtimes.py`` keeps it when it rewrites that file.

    nice -n 19 .venv/bin/python bench/optimize_wall.py minilm --runtime auto --nncf \\
        --into bench/RESULTS-runtimes.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench_out import figure, reproduce_command
from slimline.commands import resolve_recipe
from slimline.cpu import detect
from slimline.measure.host import busy_cores
from slimline.record import atomic_write_text

TARGET_S = 480.0  # issue 15: `slimline optimize minilm` with runtime auto under 8 minutes
MARK = "<!-- optimize-wall:{key} -->"
END = "<!-- /optimize-wall:{key} -->"


def write_recipe(name: str, runtime: str | None, nncf: bool, path: Path) -> dict[str, Any]:
    """The recipe the command runs: the named one, with the runtime and NNCF switch applied."""
    raw: dict[str, Any] = resolve_recipe(name).to_dict()
    if runtime:
        raw["target"]["runtime"] = runtime
    if nncf:
        for st in raw["steps"]:
            if isinstance(st, dict) and "quantize" in st:
                st["quantize"] = {**(st["quantize"] or {}), "nncf": True}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return raw


class LoadSampler:
    """The 1-minute load average, sampled every ``every`` seconds while the command runs."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def time_v_fields(stderr: str) -> dict[str, str]:
    """``/usr/bin/time -v``'s report, by field name."""
    out: dict[str, str] = {}
    for line in stderr.splitlines():
        key, sep, value = line.strip().rpartition(": ")
        if sep and key:
            out[key] = value
    return out


def elapsed_s(text: str) -> float | None:
    """``h:mm:ss`` or ``m:ss.ss`` as seconds."""
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        return None
    secs = 0.0
    for p in parts:
        secs = secs * 60 + p
    return secs


def run_command(recipe: Path, work: Path) -> dict[str, Any]:
    cache, out = work / "cache", work / "run"
    for d in (cache, out):
        shutil.rmtree(d, ignore_errors=True)
    exe = str(Path(sys.executable).parent / "slimline")
    cmd = [exe, "optimize", str(recipe), "--out", str(out)]
    timer = shutil.which("time") and Path("/usr/bin/time").is_file()
    env = {**os.environ, "SLIMLINE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    before = {"busy_cores": busy_cores(1.0), "loadavg": os.getloadavg()}
    t0 = time.perf_counter()
    with LoadSampler() as load:
        proc = subprocess.run(
            (["/usr/bin/time", "-v"] if timer else []) + cmd,
            env=env,
            capture_output=True,
            text=True,
        )
    wall = time.perf_counter() - t0
    after = {"busy_cores": busy_cores(1.0), "loadavg": os.getloadavg()}
    (work / "optimize.log").write_text(proc.stdout + proc.stderr)
    tv = time_v_fields(proc.stderr) if timer else {}
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    return {
        "command": " ".join(["slimline", *cmd[1:]]),
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "time_v_wall_s": elapsed_s(tv.get("Elapsed (wall clock) time (h:mm:ss or m:ss)", "")),
        "user_s": float(tv["User time (seconds)"]) if "User time (seconds)" in tv else None,
        "system_s": float(tv["System time (seconds)"]) if "System time (seconds)" in tv else None,
        "max_rss_mb": int(tv["Maximum resident set size (kbytes)"]) / 1024
        if "Maximum resident set size (kbytes)" in tv
        else None,
        "load_before": before,
        "load_after": after,
        "load_during": {"mean": sum(load.samples) / len(load.samples), "max": max(load.samples)},
        "manifest": manifest,
    }


def _phases(manifest: dict[str, Any]) -> list[str]:
    phases: dict[str, float] = manifest.get("phase_seconds") or {}
    rows = ["| phase | seconds |", "|---|---|"]
    rows += [f"| {k} | {v:.1f} |" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])]
    steps = [
        (c["name"], c["meta"]["timings_s"])
        for c in manifest.get("candidates", [])
        if isinstance(c.get("meta", {}).get("timings_s"), dict)
    ]
    for name, timings in steps:
        inner = ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
        rows.append(f"\nInside the step behind `{name}` (seconds): {inner}.")
    nncf = [
        c["meta"]["nncf"] for c in manifest.get("candidates", []) if "nncf" in c.get("meta", {})
    ]
    for n in nncf:
        rows.append(f"NNCF's quantization (inside the quantize step): {n.get('wall_s')} s.")
    return rows


def render(key: str, r: dict[str, Any], raw: dict[str, Any], argv: list[str]) -> str:
    cpu = detect()
    m = r["manifest"]
    pick = m.get("runtime_pick") or {}
    lb, la, ld = r["load_before"], r["load_after"], r["load_during"]
    under = r["wall_s"] <= TARGET_S
    lines = [
        MARK.format(key=key),
        f"## `slimline optimize {raw['name']}` with `runtime: {raw['target']['runtime']}`: "
        "wall time, cold cache",
        "",
        f"CPU kind **{cpu.kind}** ({', '.join(sorted(cpu.features))}), {os.cpu_count()} cores, "
        f"{raw['target']['threads']} threads. Load average (1 min) {lb['loadavg'][0]:.2f} before, "
        f"{ld['mean']:.2f} mean and {ld['max']:.2f} max during, {la['loadavg'][0]:.2f} after; "
        f"other processes used {figure(lb['busy_cores'], '.1f')} cores just before and "
        f"{figure(la['busy_cores'], '.1f')} just after.",
        "",
        f"**{r['wall_s']:.0f} s** wall (`/usr/bin/time -v`: {figure(r['time_v_wall_s'], '.0f')} s, "
        f"user {figure(r['user_s'], '.0f')} s, system {figure(r['system_s'], '.0f')} s, max RSS "
        f"{figure(r['max_rss_mb'], '.0f')} MB; the manifest's wall {figure(m.get('wall_seconds'), '.0f')}"
        f" s), status `{m.get('status', 'no manifest')}`, exit code {r['returncode']}: "
        + (
            f"within the {TARGET_S / 60:.0f}-minute target."
            if under and r["returncode"] == 0
            else f"**over the {TARGET_S / 60:.0f}-minute target**."
            if r["returncode"] == 0
            else "the command failed."
        ),
        "",
        f"Pick: **{pick.get('candidate')} on {pick.get('runtime')}**"
        + (f" ({pick['p50_ms']:.3f} ms p50 at batch 1)." if pick.get("p50_ms") else "."),
        "",
        "Where the time went (the manifest's `phase_seconds`: steps that ran, each accept/reject "
        "judgement per runtime, the final benchmark and its quality/RSS pass):",
        "",
        *_phases(m),
        "",
        f"Recipe: `{argv[0] if argv else raw['name']}`"
        + (f" with `target.runtime: {raw['target']['runtime']}`" if "--runtime" in argv else "")
        + (" and `quantize: {nncf: true}`" if "--nncf" in argv else "")
        + f"; target {_brief(raw['target'])}; budget {_brief(raw['budget'])}; bench "
        f"{_brief(raw['bench'])}; steps: {', '.join(_step_kind(st) for st in raw['steps'])}.",
        "",
        "Command (run by the script, cold `SLIMLINE_CACHE`):",
        "",
        f"    {r['command']}",
        "",
        "Reproduce:",
        "",
        f"    nice -n 19 {reproduce_command('optimize_wall.py', argv)}",
        "",
        END.format(key=key),
    ]
    return "\n".join(lines)


def _brief(section: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in section.items() if k != "version") + "}"


def _step_kind(step: Any) -> str:
    return step if isinstance(step, str) else next(iter(step))


def put_section(path: Path, key: str, section: str) -> None:
    """``section`` into ``path`` in place of its earlier one, else at the end."""
    text = path.read_text() if path.is_file() else ""
    pattern = re.compile(
        re.escape(MARK.format(key=key)) + r".*?" + re.escape(END.format(key=key)), re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("recipe", help="built-in recipe name or YAML file")
    p.add_argument("--runtime", choices=["onnxruntime", "openvino", "auto"], default=None)
    p.add_argument("--nncf", action="store_true", help="quantize: {nncf: true}")
    p.add_argument("--work", type=Path, default=Path("/tmp/slimline-optimize-wall"))
    p.add_argument("--into", type=Path, default=None, help="results file to put the section in")
    args = p.parse_args(argv)
    key = f"{Path(args.recipe).stem}-{args.runtime or 'recipe'}{'-nncf' if args.nncf else ''}"
    recipe = args.work / f"{key}.yaml"
    raw = write_recipe(args.recipe, args.runtime, args.nncf, recipe)
    r = run_command(recipe, args.work / key)
    text = render(key, r, raw, sys.argv[1:] if argv is None else argv)
    print(text)
    (args.work / f"{key}.json").write_text(
        json.dumps({k: v for k, v in r.items() if k != "manifest"}, indent=1, default=str)
    )
    if args.into is not None:
        put_section(args.into, key, text)
    return 0 if r["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
