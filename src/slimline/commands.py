"""Core subcommands: optimize, profile, report, check, examples."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .errors import RecipeError

__all__ = ["register", "resolve_recipe"]

RECIPES_DIR = Path(__file__).parent / "examples" / "recipes"


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def resolve_recipe(arg: str) -> Any:
    from .recipe import load_recipe

    path = Path(arg)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_recipe(path)
    builtin = builtin_recipes()
    if arg in builtin:
        return load_recipe(builtin[arg])
    raise RecipeError(
        f"{arg!r} is neither a recipe file nor a built-in recipe ({', '.join(builtin)}); "
        "`slimline examples` lists the built-ins"
    )


def _apply_overrides(recipe: Any, args: argparse.Namespace) -> Any:
    if getattr(args, "threads", None):
        recipe = recipe.model_copy(
            update={"target": recipe.target.model_copy(update={"threads": args.threads})}
        )
    if getattr(args, "runtime", None):
        recipe = recipe.model_copy(
            update={"target": recipe.target.model_copy(update={"runtime": args.runtime})}
        )
    if getattr(args, "memory_mb", None) is not None:
        recipe = recipe.model_copy(
            update={"target": recipe.target.model_copy(update={"memory_mb": args.memory_mb})}
        )
    return recipe


def revalidated(recipe: Any) -> Any:
    """``recipe`` with its command-line overrides validated the way a file's fields are. Only
    the fields the recipe set travel: a step's defaults stay defaults (the quantize step's
    automatic mode tries the first/last layers in INT8, and picks the INT8 format for this CPU,
    only where the recipe did not set them)."""
    from .recipe import recipe_from_dict

    return recipe_from_dict(recipe.to_dict(explicit=True))


def _finish(run_out: Path) -> None:
    from .record import load_manifest
    from .report.html import summary_table

    print(summary_table(load_manifest(run_out)))
    print(f"\nrun directory: {run_out}\nreport: {run_out / 'report.html'}")


def cmd_optimize(args: argparse.Namespace) -> int:
    from .pipeline import run_recipe

    recipe = revalidated(_apply_overrides(resolve_recipe(args.recipe), args))
    if args.print_recipe:
        sys.stdout.write(recipe.to_yaml())
        return 0
    if args.save_recipe:
        from .record import atomic_write_text

        atomic_write_text(Path(args.save_recipe), recipe.to_yaml())
    run = run_recipe(recipe, args.out, cache=args.cache, remeasure=args.remeasure)
    _finish(run.out)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .pipeline import run_recipe
    from .recipe import Recipe

    name = "profile-" + Path(args.task).stem.replace(" ", "_")
    recipe = Recipe(
        name=name,
        task=str(Path(args.task).resolve()) if args.task.endswith((".py", ".onnx")) else args.task,
        samples=str(Path(args.samples).resolve()) if args.samples else None,
        eval_samples=str(Path(args.eval_samples).resolve()) if args.eval_samples else None,
    )
    recipe = _apply_overrides(recipe, args)
    if args.memory_mb is not None:
        recipe = revalidated(recipe)  # the budget is checked as a file's would be
    run = run_recipe(recipe, args.out, cache=args.cache, remeasure=args.remeasure)
    _finish(run.out)
    _suggest_kinds(run)
    return 0


def _suggest_kinds(run: Any) -> None:
    """One line per output that looks like a kind (:func:`slimline.outputs.suggest`), and per
    input that looks constant: a suggestion to declare it, never applied."""
    from .outputs import suggest

    outputs = (run.reference.all_outputs if run.reference else None) or {}
    for name, values in outputs.items():
        line = suggest(name, values)
        if line:
            print(f"suggestion: {line}")
    if run.task.is_onnx:  # inputs that look constant (constant_inputs.suggest_constants)
        from .constant_inputs import suggest_constants

        for line in suggest_constants(run.task):
            print(f"suggestion: {line}")


def cmd_report(args: argparse.Namespace) -> int:
    from .record import load_manifest
    from .report.html import summary_table, write_report

    out = write_report(Path(args.run_dir))
    print(summary_table(load_manifest(args.run_dir)))
    print(f"\nreport: {out}")
    return 0


def _check_hardware(current: Any, baseline: Any, allow: bool) -> None:
    """Latency compares only like targets: a different CPU, thread count or runtime is an error,
    or with ``--allow-hardware-change`` a printed warning. What a manifest lacks is printed."""
    from .errors import HardwareMismatchError
    from .gate import hardware_differences

    differs, unknown = hardware_differences(current, baseline)
    for u in unknown:
        print(f"note: not compared: {u}")
    if not differs:
        return
    msg = f"the baseline ran on another target: {'; '.join(differs)}"
    if not allow:
        raise HardwareMismatchError(
            f"{msg}; gate against a baseline from the same machine kind, or pass "
            "--allow-hardware-change to compare anyway"
        )
    print(f"warning: {msg} (--allow-hardware-change: compared anyway)")


def _check_environment(current: Any, baseline: Any) -> None:
    """Packages that differ from a run's lock or between the runs: a warning, not a failure."""
    from .gate import environment_differences

    warnings, unknown = environment_differences(current, baseline)
    for u in unknown:
        print(f"note: not compared: {u}")
    for w in warnings:
        print(f"warning: {w} (compared anyway: a figure that moved may owe it to them)")


def cmd_check(args: argparse.Namespace) -> int:
    from .gate import compare_manifests
    from .record import load_manifest

    current, baseline = load_manifest(args.run_dir), load_manifest(args.baseline)
    _check_hardware(current, baseline, args.allow_hardware_change)
    _check_environment(current, baseline)
    regressions, notes = compare_manifests(
        current,
        baseline,
        max_latency_regression=args.max_latency_regression,
        max_metric_drop=args.max_metric_drop,
    )
    for n in notes:
        print(n)
    for r in regressions:
        print(r)
    if regressions:
        print(f"check FAILED: {len(regressions)} regression(s)")
        return 1
    print("check passed: no regression beyond tolerance and noise")
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from .examples import DESCRIPTIONS, EXAMPLES

    print("tasks:")
    for name in sorted(EXAMPLES):
        print(f"  {name:14s} {DESCRIPTIONS.get(name, '')}")
    print("recipes (slimline optimize NAME):")
    for name, path in builtin_recipes().items():
        print(f"  {name:14s} {path}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="run directory (default runs/<name>-<time>-<hash>)")
    p.add_argument(
        "--cache", type=Path, help="step cache (default $SLIMLINE_CACHE or ~/.cache/slimline)"
    )
    p.add_argument("--threads", type=int, help="override the target's thread count")
    p.add_argument(
        "--runtime",
        choices=["onnxruntime", "openvino", "auto"],
        help="override the target's runtime (auto: measure both, serve the faster pair)",
    )
    p.add_argument(
        "--memory-mb",
        type=float,
        help="peak RSS budget: choose the runtime setting that fits it (docs/edge.md)",
    )
    p.add_argument(
        "--remeasure", action="store_true", help="measure again instead of reusing cached figures"
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "optimize", help="run a recipe: prune -> recover -> quantize -> verify -> benchmark"
    )
    p.add_argument(
        "recipe", help="recipe YAML file or built-in recipe name (see `slimline examples`)"
    )
    _common(p)
    p.add_argument(
        "--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit"
    )
    p.add_argument("--save-recipe", type=Path, help="also write the resolved recipe to this file")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser(
        "profile", help="baseline only: latency, throughput, memory, size, per-op time, weights"
    )
    p.add_argument("task", help="example name, task .py file, or model .onnx file")
    p.add_argument("--samples", help=".npz of sample inputs (for an .onnx task)")
    p.add_argument(
        "--eval-samples",
        help=".npz of evaluation inputs (for an .onnx task); default: rows held out of --samples",
    )
    _common(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("report", help="rebuild report.html of a run and print its summary")
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "check", help="CI gate: exit 1 when a run regressed against a baseline manifest"
    )
    p.add_argument("run_dir", help="run directory or manifest.json")
    p.add_argument("--baseline", required=True, help="baseline manifest.json (or run directory)")
    p.add_argument("--max-latency-regression", type=float, default=0.10)
    p.add_argument("--max-metric-drop", type=float, default=0.005)
    p.add_argument(
        "--allow-hardware-change",
        action="store_true",
        help="compare even when the CPU features, cores, threads or onnxruntime version differ",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("examples", help="list the built-in example tasks and recipes")
    p.set_defaults(func=cmd_examples)
