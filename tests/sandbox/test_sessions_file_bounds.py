"""The host reads a ``local`` sandbox's sessions file (which code in that sandbox can write) with bounds: no link
followed, no FIFO blocked on, no more than a bounded size read and decoded. A marker-carrying child stands for a
session leader the execution server started; the first test is the positive control the others are measured by."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from sandbox.sessions import MARKER_VAR, SESSIONS_FILE_MAX_BYTES, live_session_ids, start_ticks

pytestmark = [pytest.mark.real]  # starts a child process


@pytest.fixture
def leader():
    sid = "sbx-test-sessions"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, MARKER_VAR: sid})
    try:
        yield sid, child.pid
    finally:
        child.kill()
        child.wait()


def _entry(pid: int) -> dict:
    return {"bash": {"pid": pid, "start_ticks": start_ticks(pid)}}


def test_a_well_formed_sessions_file_names_its_leader(tmp_path, leader):
    sid, pid = leader
    path = tmp_path / "sessions.json"
    path.write_text(json.dumps(_entry(pid)))
    assert live_session_ids(str(path), sid) == {pid}


def test_a_sessions_file_over_the_bound_is_not_decoded(tmp_path, leader):
    sid, pid = leader
    path = tmp_path / "sessions.json"
    body = json.dumps({**_entry(pid), "pad": "x" * SESSIONS_FILE_MAX_BYTES})
    path.write_text(body)
    assert live_session_ids(str(path), sid) == set()


def test_a_sessions_file_replaced_by_a_link_is_not_followed(tmp_path, leader):
    sid, pid = leader
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(_entry(pid)))
    path = tmp_path / "sessions.json"
    path.symlink_to(target)
    assert live_session_ids(str(path), sid) == set()


def test_a_sessions_file_replaced_by_a_fifo_never_blocks_the_host(tmp_path, leader):
    sid, _ = leader
    path = tmp_path / "sessions.json"
    os.mkfifo(path)
    out: list = []
    reader = threading.Thread(target=lambda: out.append(live_session_ids(str(path), sid)), daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # unblock the stuck open so the test process can end
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert out == [set()]
