"""The shipped Prometheus alert rules: promtool's own check and unit tests (scripts/setup.sh
installs promtool; under CI=true a missing promtool fails), and everywhere a structural check
plus a check that every metric they use exists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from slimline.serve.metrics import ServeMetrics

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = RULES_DIR / "slimline-alerts.yml"
RULE_TESTS = RULES_DIR / "slimline-alerts.test.yml"
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def test_promtool_checks_and_unit_tests_pass() -> None:
    if shutil.which("promtool") is None:
        message = "promtool is not installed; scripts/setup.sh installs it (Debian: prometheus)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)  # CI must check the rules users load, never skip them
        pytest.skip(message)
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_rules_follow_the_rules_file_schema() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    alerts = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule)
            allowed = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if "record" in rule:
                allowed = {"record", "expr", "labels"}
                assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"])
            assert set(rule) <= allowed, rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert _balanced(rule["expr"])
            if "for" in rule:
                assert DURATION.match(rule["for"])
            for key in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in rule.get(key, {}).values())
            if "alert" in rule:
                alerts.add(rule["alert"])
    assert alerts == {"SlimlineP99AboveSLO", "SlimlineRejectingRequests", "SlimlineMemoryGrowing"}


def test_every_metric_the_rules_use_is_exposed_by_the_server() -> None:
    metrics = ServeMetrics(max_batch_size=8)
    metrics.add_model("m")
    metrics.latency.labels("m").observe(0.01)
    exposed = {
        line.split("{")[0].split(" ")[0]
        for line in metrics.exposition().decode().splitlines()
        if line and not line.startswith("#")
    }
    text = RULES.read_text()
    used = set(re.findall(r"\b((?:slimline|process)_[a-z_]+)\b", text))
    assert used, "the rules use no metric"
    assert used <= exposed, used - exposed
    assert 'outcome=~"rejected|timeout"' in text


def _balanced(expr: str) -> bool:
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0
