"""``slimline cascade calibrate EDGE CLOUD``: the cascade's threshold from the task's data."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import SlimlineError

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("cascade", help="edge-cloud cascade: calibrate the escalation threshold")
    cascade_sub = p.add_subparsers(dest="cascade_command", metavar="SUBCOMMAND", required=True)
    c = cascade_sub.add_parser(
        "calibrate",
        help="sweep the threshold on the task's evaluation data; write the curve and the pick",
    )
    c.add_argument("edge", type=Path, help="edge model: run directory or .onnx file")
    c.add_argument("cloud", type=Path, help="cloud model: run directory or .onnx file")
    c.add_argument("--task", help="example name or task .py (default: the edge run's task)")
    c.add_argument("--score", help="softmax, probability, margin or FILE.py:FUNCTION "
                   "(default: the task's cascade_score, else softmax)")  # fmt: skip
    c.add_argument("--target-escalation", type=float,
                   help="pick the best metric escalating at most this share of rows")  # fmt: skip
    c.add_argument("--max-loss", type=float,
                   help="pick the least escalation within this metric loss of the cloud "
                   "(default 0.001 when no target is given)")  # fmt: skip
    c.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads")
    c.add_argument("--limit", type=int, help="evaluate at most this many rows")
    c.add_argument("--out", type=Path, default=Path("cascade.json"),
                   help="calibration JSON (the plot is written beside it as .png)")  # fmt: skip
    c.set_defaults(func=cmd_calibrate)


def _check(args: argparse.Namespace) -> None:
    rate, loss = args.target_escalation, args.max_loss
    if rate is not None and not 0.0 <= rate <= 1.0:
        raise SlimlineError(f"--target-escalation is {rate:g}; give a share between 0 and 1")
    if loss is not None and loss < 0:
        raise SlimlineError(f"--max-loss is {loss:g}; give a loss of 0 or more")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate, write_calibration

    _check(args)
    doc = calibrate(
        args.edge,
        args.cloud,
        task_spec=args.task,
        score=args.score,
        target_escalation=args.target_escalation,
        max_loss=args.max_loss,
        threads=args.threads,
        limit=args.limit,
    )
    png = write_calibration(doc, args.out)
    chosen = doc["chosen"]
    print(
        f"{doc['task']}: edge {doc['edge_metric']:.4f}, cloud {doc['cloud_metric']:.4f} "
        f"({doc['metric_name']}, {doc['rows']} rows, score {doc['score']})\n"
        f"threshold {chosen['threshold']:.6g}: {chosen['escalation']:.1%} escalated, "
        f"cascade {chosen['metric']:.4f}\ncurve: {args.out} and {png}\n"
        f"serve: slimline serve --cascade {args.edge} {args.cloud} --cascade-threshold {args.out}"
    )
    return 0
