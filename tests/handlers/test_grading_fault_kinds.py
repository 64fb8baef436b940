"""What the ``code`` and ``swe`` handlers' own steps raise when the sandbox or git fails around grading: an
infrastructure fault (filtered, never trained on), not a 0.0 the model is trained on nor a "handler" bug.

The handles here are TEST DOUBLES standing for a sandbox whose process died after the agent's run (``code``)
and for a repository copy that failed (``swe``); the real sandbox behaviour is covered in the real tier.
"""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from handlers.code import plain
from handlers.code.data import humaneval_problems
from handlers.code.grader import run_tests
from handlers.code.grading import HOST_MESSAGE_BOUNDS, GradingLimits, _from_grader, _Peer
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


# ------------------------------------------------------------------------------------------ message bounds
# A bound crossed because of the candidate's data is its failed test (scored 0.0), never a grader fault: the
# grader cuts what it quotes of the candidate, and every side sends only what its receiver accepts.
#: HumanEval/77 (``iscube``), whose assertions quote the candidate's value: ``"First test error: " +
#: str(candidate(1))``. 1.4 MB of bytes passes the host's bound as an answer (its base64 is 1.87 MB) and its
#: ``str`` is 5.6 MB, 7 MB once escaped in JSON: past the host's 2 MiB, under the grader's old 8 MiB.
HUGE_ANSWER = bytes(1_400_000)


class HostEnd:
    """The host's end of the grader's channel, in this process: a TEST DOUBLE for the host relaying a
    candidate that answers every call with ``answer`` (relayed as the host relays a value). The real grader
    (:func:`handlers.code.grader.run_tests`) talks to it; every line it sends is kept in ``lines``."""

    def __init__(self, answer) -> None:
        self.sock = self  # the grader writes its calls to chan.sock
        self.lines: list[bytes] = []
        self.replies: list[dict] = [{"start": True}]
        self.answer = plain.encode(answer)

    def send(self, message: dict) -> None:
        self.lines.append(line_of(message))

    def sendall(self, line: bytes) -> None:
        self.lines.append(line)
        self.replies.append({"value": self.answer})

    def recv(self) -> dict:
        return self.replies.pop(0)


def line_of(message: dict) -> bytes:
    """``message`` as the grader writes it (plain.dumps_line's JSON), whatever its size."""
    return json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


async def host_reads(line: bytes):
    """What the host's real reader makes of the grader's ``line`` (``_from_grader`` over a socket pair):
    the result of grading (a tuple) for a verdict; raises ``GraderError`` for a line it refuses."""
    host_sock, g_sock = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=host_sock, limit=plain.MAX_MESSAGE_BYTES)
    g_sock.setblocking(False)
    loop = asyncio.get_running_loop()
    sending = asyncio.ensure_future(loop.sock_sendall(g_sock, line))
    g_task = loop.create_future()  # the grader's process, still running
    try:
        return await _from_grader(_Peer(reader, writer), g_task, loop.time() + 30, GradingLimits())
    finally:
        sending.cancel()
        writer.close()
        g_sock.close()


def grade_in_process(tests: str, answer, entry_point: str = "iscube") -> tuple[HostEnd, dict]:
    host = HostEnd(answer)
    result = run_tests(host, {"prompt": "", "tests": tests, "entry_point": entry_point})
    return host, result


async def test_an_assertion_quoting_a_huge_wrong_answer_is_a_failed_test_not_a_grader_fault():
    problem = humaneval_problems()["HumanEval/77"]
    # the answer itself is within what the host accepts from the candidate
    assert len(plain.dumps_line({"id": 1, "value": plain.encode(HUGE_ANSWER)})) <= HOST_MESSAGE_BOUNDS.max_bytes
    host, result = grade_in_process(problem["test"], HUGE_ANSWER)
    line = line_of(result)  # what the grader's main() sends
    assert len(line) <= HOST_MESSAGE_BOUNDS.max_bytes, f"a verdict of {len(line)} bytes"
    reward, info = await host_reads(line)
    assert reward == 0.0 and info["passed"] is False
    assert info["error"].startswith("AssertionError: First test error: b'\\x00\\x00")
    assert len(info["error"]) <= plain.MAX_TEXT_CHARS
    assert "candidate(1) == True" in info["failed_test"]


async def test_a_call_built_from_the_candidates_answers_past_the_bound_fails_the_candidate():
    tests = "def check(candidate):\n    x = candidate(1)\n    assert candidate(x + x) == 1\n"
    host, result = grade_in_process(tests, HUGE_ANSWER)
    assert all(len(line) <= HOST_MESSAGE_BOUNDS.max_bytes for line in host.lines), \
        [len(line) for line in host.lines]
    reward, info = await host_reads(line_of(result))
    assert reward == 0.0 and "too large to send" in info["error"]
    # the tests' own argument too large, before the candidate answered anything: the instance's fault
    host, result = grade_in_process("def check(candidate):\n    candidate(bytes(3 << 20))\n", True)
    assert "invalid_tests" in result and "too large" in result["invalid_tests"]
    assert all(len(line) <= HOST_MESSAGE_BOUNDS.max_bytes for line in host.lines)


@pytest.mark.real
async def test_a_huge_wrong_answer_quoted_by_humaneval_tests_is_scored_in_real_grading_and_regrade(
        bwrap_runtime, sandbox_procs):
    """Real bubblewrap grading of HumanEval/77, 78, 95, 97, 117 and 148 with a solution returning 1.4 MB of
    bytes (their tests quote the value in an assertion message): a scored 0.0 with the failed assertion, not a GraderError; and
    ``prorl-journal regrade`` (the Regrader) turns the ``harness`` failure such a job was recorded with into
    that scored 0.0."""
    from handlers.code import CodeHandler
    from handlers.code.data import to_instance
    from handlers.code.task import evaluate_solution
    from prorl_server.journal.regrade import Regrader
    from prorl_server.plugin.registry import HandlerRegistry
    from prorl_server.types import JobResult, ProcessRequest, Trajectory

    for task_id in ("HumanEval/77", "HumanEval/78", "HumanEval/95", "HumanEval/97", "HumanEval/117",
                    "HumanEval/148"):  # the problems whose tests quote the candidate's value
        problem = humaneval_problems()[task_id]
        solution = problem["prompt"] + "    return bytes(1_400_000)\n"
        reward, info = await evaluate_solution(bwrap_runtime.start, to_instance(problem), solution)
        assert reward == 0.0 and "test error: " in info["error"], (task_id, info)
    await bwrap_runtime.close_all()
    problem = humaneval_problems()["HumanEval/77"]
    solution = problem["prompt"] + "    return bytes(1_400_000)\n"

    registry = HandlerRegistry()
    registry.register(CodeHandler)
    request = ProcessRequest(instance={"data_source": "code", "instance_id": "HumanEval/77"}, job_id="huge")
    recorded = JobResult(job_id="huge", trajectory_id="t", handler="code", critical_error="eval",
                         failure_kind="harness", filter=True, error="eval failed: GraderError: the grader sent a "
                         "malformed message: message longer than 2097152 bytes", extra={"solution": solution},
                         trajectories=[Trajectory(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0],
                                                  loss_mask=[1], num_turns=1)])
    async with Regrader(registry, sandbox_runtime="bubblewrap") as regrader:
        out = await regrader.regrade("huge", "code", request.model_dump_json().encode(),
                                     recorded.model_dump_json().encode())
    assert (out.status, out.new_reward, out.failure_kind) == ("regraded", 0.0, None), out.reason
    assert out.result.filter is False and out.result.extra["eval"]["failed_test"].startswith("assert candidate(1)")
    assert not sandbox_procs()


# ------------------------------------------------------------------------------ preparing the grading sandboxes
@pytest.mark.parametrize("where", ["host-directories", "sandbox-start"])
async def test_grading_sandboxes_that_cannot_be_prepared_are_a_start_failure_not_the_solutions(monkeypatch, where):
    """Fault injection: the host's disk is full when the grading directories are made, or the runtime's start
    (a TEST DOUBLE for bubblewrap's) is refused a cgroup. The right solution was never run: a filtered start
    failure (``sandbox``) even though the model acted, never ``model_error``."""
    from handlers.code import grading
    from handlers.code.data import to_instance
    from handlers.code.task import evaluate_solution

    if where == "host-directories":
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device", "/tmp/prorl-code-1-2-x")
        monkeypatch.setattr(grading.tempfile, "mkdtemp", disk_full)

    async def open_sandbox(spec):
        raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/prorl/sb-1/cgroup.procs")

    problem = humaneval_problems()["HumanEval/0"]
    with pytest.raises(Exception) as e:
        await evaluate_solution(open_sandbox, to_instance(problem), problem["prompt"] + problem["canonical_solution"])
    assert classify(e.value, "eval", model_acted=True) == "sandbox", repr(e.value)


async def test_tests_too_large_for_the_graders_message_are_refused_at_submit_and_invalid_at_grading():
    """The grader receives the prompt and tests in one bounded message: an inline instance whose tests cannot
    fit is refused when submitted (naming the field), and one that reaches grading anyway is invalid, never a
    failure of the model's answer."""
    from handlers.code import CodeHandler
    from handlers.code.task import evaluate_solution
    from prorl_server.plugin.handler import InstanceValidationError

    huge = {"data_source": "code", "entry_point": "f", "prompt": "def f():\n    pass\n",
            "tests": "def check(candidate):\n    assert candidate() == " + repr("x" * (9 << 20)) + "\n"}
    with pytest.raises(InstanceValidationError, match="tests"):
        CodeHandler().prepare_instance(dict(huge))

    async def open_sandbox(spec):  # never reached
        raise AssertionError("a sandbox was opened for an instance the grader cannot receive")

    with pytest.raises(Exception) as e:
        await evaluate_solution(open_sandbox, huge, "def f():\n    return 1\n")
    assert classify(e.value, "eval", model_acted=True) == "invalid_instance", repr(e.value)


class DeadOnArrival:
    """A TEST DOUBLE for a fresh eval sandbox killed from outside before anything of the model's was put in it:
    every call raises ``SandboxDeadError``."""

    async def bash(self, command: str, timeout_s: float = 30.0):
        raise SandboxDeadError("sandbox sb-2 died (exit status -9)")

    async def upload(self, path: str, data: bytes):
        raise SandboxDeadError("sandbox sb-2 died (exit status -9)")


async def test_a_swe_eval_sandbox_dying_before_the_patch_is_put_in_is_a_start_failure():
    from types import SimpleNamespace

    from handlers.swe.handler import SweHandler, SweState

    async def open_sandbox(spec):
        return DeadOnArrival()

    job = SimpleNamespace(instance={"repo_path": "/repo", "FAIL_TO_PASS": ["t.py::test"], "PASS_TO_PASS": []},
                          state=SweState(patch="diff --git a/x b/x\n"), open_sandbox=open_sandbox, extra={})
    with pytest.raises(Exception) as e:
        await SweHandler().eval(job)
    assert classify(e.value, "eval", model_acted=True) == "sandbox", repr(e.value)
