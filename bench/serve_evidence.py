"""Evidence from the test suite for bench/RESULTS-serve.md: the tritonclient integration test
(JSON and binary) and the batcher's behaviour tests, run verbosely, their PASSED lines quoted.

    .venv/bin/python bench/serve_evidence.py
"""

from __future__ import annotations

import subprocess
import sys

from serve_common import BENCH, write_section

TESTS = [
    "tests/serve/test_serve_tritonclient.py",
    "tests/serve/test_serve_batcher.py",
    "tests/serve/test_serve_shutdown.py",
    "tests/serve/test_serve_alert_rules.py",
]


def main() -> None:
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *TESTS]
    done = subprocess.run(cmd, cwd=BENCH.parent, capture_output=True, text=True, timeout=900)
    lines = [ln.split(" ")[0].split("::", 1)[1] + "  " + ln.split(" ")[1]
             for ln in done.stdout.splitlines() if "::" in ln and (" PASSED" in ln or " FAILED" in ln
                                                                   or " SKIPPED" in ln)]  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1]
    md = (
        "## Tests behind the claims\n\n"
        "tritonclient[http] (unmodified) against the server, JSON and binary; the batcher "
        "alone (mixed request sizes split exactly, max_batch_size never exceeded, a full queue "
        "rejects in < 5 ms, a queued request times out within 10 ms of its deadline while a "
        "long batch runs and never runs); SIGTERM drain; promtool on the alert rules.\n\n"
        "```\n" + "\n".join(lines) + f"\n{summary}\n```\n\n"
        "Reproduce: `.venv/bin/pytest -v " + " ".join(TESTS) + "`"
    )
    write_section("tests", md)
    print(md)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
