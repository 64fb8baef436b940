"""The code handler's host-side grading directories never outlive a cancelled grading (found by the fault
benchmark, benchmarks/faults.py: a server's SIGTERM, which cancels every job, left a ``prorl-code-*``
directory behind)."""
from __future__ import annotations

import asyncio
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
