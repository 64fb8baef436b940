"""What the ``code`` and ``swe`` handlers' own steps raise when the sandbox or git fails around grading: an
infrastructure fault (filtered, never trained on), not a 0.0 the model is trained on nor a "handler" bug.

The handles here are TEST DOUBLES standing for a sandbox whose process died after the agent's run (``code``)
and for a repository copy that failed (``swe``); the real sandbox behaviour is covered in the real tier.
"""
from __future__ import annotations

import pytest

from handlers.code.handler import _read_solution
from handlers.swe.handler import _checkout
from prorl_server.failures import classify
from sandbox import BashResult, FileTransferError, SandboxDeadError


class Download:
    """A sandbox handle whose ``download`` raises ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def download(self, path: str, max_bytes: int = 0) -> bytes:
        raise self.exc


async def test_a_solution_file_the_agent_never_wrote_is_no_solution():
    assert await _read_solution(Download(FileTransferError("no such file: solution.py"))) is None


async def test_a_sandbox_dead_when_the_solution_is_read_fails_the_job_as_a_sandbox_fault():
    with pytest.raises(SandboxDeadError) as e:
        await _read_solution(Download(SandboxDeadError("sandbox sb-1 died (exit status -9)")))
    assert classify(e.value, "run") == "sandbox"


class FailingBash:
    async def bash(self, command: str, timeout_s: float = 30.0) -> BashResult:
        return BashResult(output="cp: cannot stat '/repo_src/.': No such file or directory", exit_code=1)


async def test_a_repository_copy_that_fails_is_a_harness_fault():
    with pytest.raises(Exception) as e:
        await _checkout(FailingBash(), {"repo": "/nonexistent", "FAIL_TO_PASS": [], "PASS_TO_PASS": []})
    assert classify(e.value, "eval") == "harness"
    assert "could not copy the repository" in str(e.value)
