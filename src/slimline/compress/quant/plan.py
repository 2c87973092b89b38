"""Per-node precision: the explicit map, its precedence, and the default first/last rule."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import RecipeError
from .config import Precision

__all__ = ["EDGES_FLOAT", "EDGES_INT8", "MIXED", "PrecisionPlan", "resolve_plan"]

EDGES_FLOAT = "first/last compute layer"
EDGES_INT8 = "first/last compute layer, INT8 tried by automatic mode"
MIXED = "mixed precision"


@dataclass
class PrecisionPlan:
    """Precision of every compute node, with the rule that decided it."""

    precision: dict[str, Precision]
    rule: dict[str, str] = field(default_factory=dict)

    @property
    def float_nodes(self) -> list[str]:
        return [n for n, p in self.precision.items() if p == "float"]

    @property
    def int8_nodes(self) -> list[str]:
        return [n for n, p in self.precision.items() if p == "int8"]

    def with_float(self, nodes: list[str], rule: str) -> PrecisionPlan:
        precision, rules = dict(self.precision), dict(self.rule)
        for n in nodes:
            precision[n], rules[n] = "float", rule
        return PrecisionPlan(precision, rules)

    def with_int8(self, nodes: list[str], rule: str) -> PrecisionPlan:
        precision, rules = dict(self.precision), dict(self.rule)
        for n in nodes:
            precision[n], rules[n] = "int8", rule
        return PrecisionPlan(precision, rules)

    @property
    def tag(self) -> str:
        """A short suffix naming how this plan departs from the defaults."""
        rules = set(self.rule.values())
        if MIXED in rules:
            return f"-mixed{sum(r == MIXED for r in self.rule.values())}"
        if EDGES_INT8 in rules:
            return "-edges-int8"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "int8": len(self.int8_nodes),
            "float": len(self.float_nodes),
            "nodes": {
                n: {"precision": p, "rule": self.rule.get(n, "")} for n, p in self.precision.items()
            },
        }


def resolve_plan(
    compute_nodes: list[str], user_map: dict[str, Precision], keep_first_last_float: bool
) -> PrecisionPlan:
    """Precedence: exact name > first matching ``re:`` pattern (in map order) > first/last rule
    > int8. Raises :class:`RecipeError` when an exact name or a pattern matches no compute node."""
    known = set(compute_nodes)
    exact = {k: v for k, v in user_map.items() if not k.startswith("re:")}
    patterns = [(re.compile(k[3:]), k, v) for k, v in user_map.items() if k.startswith("re:")]
    _check_names(exact, patterns, compute_nodes, known)
    edge = (
        {compute_nodes[0], compute_nodes[-1]} if keep_first_last_float and compute_nodes else set()
    )
    precision: dict[str, Precision] = {}
    rule: dict[str, str] = {}
    for node in compute_nodes:
        if node in exact:
            precision[node], rule[node] = exact[node], "precision map (exact name)"
            continue
        hit = next(((key, v) for rx, key, v in patterns if rx.fullmatch(node)), None)
        if hit is not None:
            precision[node], rule[node] = hit[1], f"precision map ({hit[0]})"
        elif node in edge:
            precision[node], rule[node] = "float", EDGES_FLOAT
        else:
            precision[node], rule[node] = "int8", "default"
    return PrecisionPlan(precision, rule)


def _check_names(
    exact: dict[str, Precision],
    patterns: list[tuple[re.Pattern[str], str, Precision]],
    compute_nodes: list[str],
    known: set[str],
) -> None:
    unknown = [k for k in exact if k not in known]
    unknown += [key for rx, key, _ in patterns if not any(rx.fullmatch(n) for n in compute_nodes)]
    if unknown:
        shown = ", ".join(compute_nodes[:6]) + (", ..." if len(compute_nodes) > 6 else "")
        raise RecipeError(
            f"quantize precision map names {unknown} but no compute node matches; use node names "
            f"of the prepared graph (e.g. {shown}) or 're:<regex>' patterns"
        )
