"""Evidence from the test suite for bench/RESULTS-serve.md: the serving tests run verbosely, and
each claim written only when the tests behind it passed in this run.

    .venv/bin/python bench/serve_evidence.py

A claim whose test failed, was skipped (e.g. promtool not installed) or did not run is written
as "not measured" with the test's outcome, never as a claim. The script exits with pytest's
status after writing the section.
"""

from __future__ import annotations

import re
import subprocess
import sys

from serve_common import BENCH, write_section

TRITON = "tests/serve/test_serve_tritonclient.py"
BATCHER = "tests/serve/test_serve_batcher.py"
SHUTDOWN = "tests/serve/test_serve_shutdown.py"
ALERTS = "tests/serve/test_serve_alert_rules.py"
TESTS = [TRITON, BATCHER, SHUTDOWN, ALERTS]

# (claim, the tests that must all pass for it); each bound in a claim is the test's own assertion
CLAIMS = [
    ("tritonclient[http] (unmodified) works against the server with JSON and binary tensors",
     [f"{TRITON}::test_infer[json]", f"{TRITON}::test_infer[binary]"]),
    ("mixed request sizes are split back exactly and max_batch_size is never exceeded",
     [f"{BATCHER}::test_mixed_request_sizes_are_split_back_exactly_and_never_exceed_max"]),
    ("a full queue rejects at once (the test bounds it at 5 ms)",
     [f"{BATCHER}::test_full_queue_rejects_at_once"]),
    ("a queued request times out within 10 ms of its deadline while a long batch runs, and "
     "never runs", [f"{BATCHER}::test_queued_request_times_out_on_time_while_a_long_batch_runs_"
                    "and_never_runs"]),
    ("2,000 requests expiring in the queue never run, and finished entries do not pile up",
     [f"{BATCHER}::test_expired_requests_are_skipped_without_running_and_the_queue_stays_"
      "bounded"]),
    ("a dead batch collector fails every queued and later request at once, with the reason",
     [f"{BATCHER}::test_a_dead_collector_fails_every_request_at_once_and_says_why"]),
    ("SIGTERM drains every accepted request, then the server exits 0",
     [f"{SHUTDOWN}::test_sigterm_drains_every_accepted_request"]),
    ("promtool checks the shipped alert rules and passes their unit tests",
     [f"{ALERTS}::test_promtool_checks_and_unit_tests_pass"]),
]  # fmt: skip

OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def outcomes(stdout: str) -> dict[str, str]:
    """Test id -> outcome, from ``pytest -v`` output."""
    found = {}
    for line in stdout.splitlines():
        m = OUTCOME.match(line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def claim_lines(results: dict[str, str]) -> list[str]:
    lines = []
    for claim, tests in CLAIMS:
        bad = [(t, results.get(t, "not run")) for t in tests if results.get(t) != "PASSED"]
        if bad:
            why = ", ".join(f"{t.split('::')[1]}: {o}" for t, o in bad)
            lines.append(f"- not measured in this run ({why}): {claim}")
        else:
            lines.append(f"- {claim} (passed: {', '.join(t.split('::')[1] for t in tests)})")
    return lines


def main() -> None:
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *TESTS]
    done = subprocess.run(cmd, cwd=BENCH.parent, capture_output=True, text=True, timeout=900)
    results = outcomes(done.stdout)
    tail = done.stdout.strip().splitlines()
    summary = tail[-1] if tail else f"pytest printed nothing (exit status {done.returncode})"
    listing = [f"{t.split('::', 1)[1]}  {o}" for t, o in results.items()]
    md = "\n".join(
        [
            "## Tests behind the claims",
            "",
            *claim_lines(results),
            "",
            "```",
            *listing,
            summary,
            "```",
            "",
            f"pytest exit status: {done.returncode}. Reproduce: "
            f"`.venv/bin/python bench/serve_evidence.py` (runs `pytest -v {' '.join(TESTS)}`)",
        ]
    )
    write_section("tests", md)
    print(md)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
