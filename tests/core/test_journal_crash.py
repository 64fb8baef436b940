"""A real ``prorl-server`` process with a journal, SIGKILLed three times while jobs run and restarted on the same
port and journal (``benchmarks/journal_crash.py --quick``, run as a user runs it): no result a client received
is lost, no job id gets two different results, and the same run without a journal loses and duplicates
(so the check can fail)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]


def test_sigkilled_server_loses_no_finished_result_and_delivers_none_twice():
    out = subprocess.run([sys.executable, "benchmarks/journal_crash.py", "--quick", "--no-store"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["delivered"] == last["jobs"] == 100
    assert last["lost"] == 0 and last["delivered_twice"] == 0
    assert last["baseline_lost"] > 0 and last["baseline_delivered_twice"] > 0
