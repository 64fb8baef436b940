"""The code handler's host-side grading directories never outlive a cancelled grading (found by the fault
benchmark, benchmarks/faults.py: a server's SIGTERM, which cancels every job, left a ``prorl-code-*``
directory behind), nor a server killed with SIGKILL (the next server removes them: owner-checked)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading

import pytest

from handlers.code import grading


async def test_a_grading_cancelled_while_its_directories_are_made_leaves_none(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started, release, made = threading.Event(), threading.Event(), threading.Event()
    prepare = grading._prepare_dirs

    def held_prepare(solution):  # the real one, held until the grading has been cancelled
        started.set()
        release.wait(60)
        try:
            return prepare(solution)
        finally:
            made.set()

    monkeypatch.setattr(grading, "_prepare_dirs", held_prepare)

    async def no_sandbox(spec):
        raise AssertionError("a cancelled grading opened a sandbox")

    task = asyncio.ensure_future(grading.grade(no_sandbox, {"prompt": "", "tests": "", "entry_point": "f"},
                                               "def f():\n    return 1\n"))
    assert await asyncio.to_thread(started.wait, 60)  # hang guard
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(made.wait, 60)
    for _ in range(1000):  # hang guard: the thread finishes, then its directories are removed
        if not any(tmp_path.iterdir()):
            break
        await asyncio.sleep(0.01)
    assert list(tmp_path.iterdir()) == []


def test_directories_of_a_server_that_is_gone_are_removed_and_a_live_ones_are_kept(tmp_path, monkeypatch):
    """A server SIGKILLed mid-grading leaves its directories (no ``finally`` runs); the next server process
    removes them before its first grading. A live server's directories (this process's) stay, and so do a
    look-alike that is a link and names that are not grading directories."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        gone_prefix = grading._owner_prefix(gone.pid)
    finally:
        gone.kill()
        gone.wait()
    dead = tmp_path / f"{gone_prefix}abc123"
    (dead / "s").mkdir(parents=True)
    (dead / "s" / "solution.py").write_text("x = 1\n")
    live = tmp_path / f"{grading._owner_prefix()}def456"
    live.mkdir()
    other = tmp_path / "prorl-code-notmine"
    other.mkdir()
    target = tmp_path / "kept-target"
    target.mkdir()
    link = tmp_path / f"{gone_prefix}link99"
    os.symlink(target, link)

    assert grading._remove_dead_owners_dirs.__wrapped__() == 1
    assert not dead.exists()
    assert live.exists() and other.exists() and target.exists() and link.is_symlink()
