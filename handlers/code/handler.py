"""The ``code`` handler.

- init: start a sandbox (no network) and put the problem in ``/workspace/solution.py`` (the signature and
  docstring) for the agent to complete.
- run: the generic agent loop with ``str_replace_editor``, ``bash`` and ``ipython`` on that sandbox; the
  agent may run its own checks; afterwards ``/workspace/solution.py`` is taken as the solution.
- eval: the solution runs in a FRESH sandbox of its own and the hidden tests in another one, which the solution
  never reaches; the host relays the tests' calls as plain data (:mod:`handlers.code.grading`). Reward 1.0 if
  every test passes, else 0.0; ``extra["eval"]`` says which test failed, the error, or that a time limit was
  hit. A failure of the grader's sandbox raises :class:`~handlers.code.grading.GraderError` (the eval stage
  fails).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from prorl_server.plugin.handler import AgentHandler
from handlers.code.data import validate_instance
from handlers.code.grading import GradingLimits, grade
from prorl_server.plugin.toolkit import run_agent, sandbox_tools

SOLUTION = "solution.py"
DEFAULT_EVAL_TIMEOUT_S = 20.0
DEFAULT_CALL_TIMEOUT_S = 10.0
SYSTEM_PROMPT = ("You are a careful Python programmer working in /workspace. Use the tools to write and test "
                 "code. When the solution is complete, call the finish tool.")
USER_TEMPLATE = ("Complete the function below. The file /workspace/{solution} already holds its signature and "
                 "docstring; write the full implementation there (the signature included), test it if you "
                 "like, then call finish.\n\n```python\n{prompt}```")


def sandbox_spec(network: str = "none") -> Any:
    """The sandbox this handler needs: no network, bounded processes and memory (so a fork bomb or a runaway
    allocation in agent code or tests is contained)."""
    from sandbox import Limits, SandboxSpec

    return SandboxSpec(network=network, limits=Limits(max_processes=512, max_memory_bytes=8 << 30,
                                                      max_file_bytes=256 << 20))


async def evaluate_solution(open_sandbox: Callable[[Any], Awaitable[Any]], instance: dict[str, Any],
                            solution: Optional[str], timeout_s: float = DEFAULT_EVAL_TIMEOUT_S,
                            call_timeout_s: Optional[float] = None) -> tuple[float, dict[str, Any]]:
    """Run the hidden tests of ``instance`` against ``solution`` (Python source), the solution and the tests
    each in a fresh sandbox of its own (:mod:`handlers.code.grading`: the solution cannot reach the tests,
    the grader or its verdict).

    Args:
        open_sandbox: ``async (spec) -> SandboxHandle`` (``job.open_sandbox``, or a runtime's ``start``).
        timeout_s: wall-clock limit of the test run, seconds.
        call_timeout_s: limit of one call of the solution's function (and of loading it), seconds; default
            ``min(timeout_s, 10)``.

    Returns:
        ``(reward, info)``: reward 1.0 if all tests pass else 0.0; info has ``passed``, ``error``,
        ``failed_test``, ``timed_out``.

    Raises:
        handlers.code.grading.GraderError: the grader's sandbox failed (an infrastructure fault, not the
            solution's).
        sandbox.SandboxError: a sandbox failed to start.
    """
    if solution is None:
        return 0.0, {"passed": False, "error": f"no {SOLUTION} was written", "failed_test": None,
                     "timed_out": False}
    if call_timeout_s is None:
        call_timeout_s = min(timeout_s, DEFAULT_CALL_TIMEOUT_S)
    return await grade(open_sandbox, instance, solution, GradingLimits(timeout_s=timeout_s,
                                                                       call_timeout_s=call_timeout_s))


class CodeHandler(AgentHandler):
    """Instance: ``{"data_source": "code", "prompt", "tests", "entry_point"}`` (HumanEval or inline);
    optional ``max_turns`` (default 8), ``eval_timeout_s`` (default 20) and ``eval_call_timeout_s`` (default
    ``min(eval_timeout_s, 10)``)."""

    name = "code"
    aliases = ("humaneval",)
    needs_llm = True

    async def init(self, job) -> None:
        validate_instance(job.instance)
        handle = await job.open_sandbox(sandbox_spec())
        await handle.upload(SOLUTION, job.instance["prompt"].encode())
        job.state["sandbox"] = handle

    async def run(self, job) -> None:
        from prorl_server.agent_loop import AgentConfig

        handle = job.state["sandbox"]
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": USER_TEMPLATE.format(solution=SOLUTION,
                                                                     prompt=job.instance["prompt"])}]
        tools = sandbox_tools(handle, ("str_replace_editor", "bash", "ipython"))
        try:
            await run_agent(job, messages, tools, AgentConfig(max_turns=int(job.instance.get("max_turns", 8))))
        finally:
            # Whatever happened, keep what the agent wrote: eval scores the file, not the conversation.
            job.state["solution"] = await _read_solution(handle)

    async def eval(self, job) -> None:
        call_timeout = job.instance.get("eval_call_timeout_s")
        reward, info = await evaluate_solution(job.open_sandbox, job.instance, job.state.get("solution"),
                                               float(job.instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)),
                                               None if call_timeout is None else float(call_timeout))
        job.reward, job.resolved = reward, reward == 1.0
        job.extra["eval"] = info


async def _read_solution(handle) -> Optional[str]:
    """The agent's solution file, or None when it wrote none (a missing or unreadable file is the agent's
    doing: graded as no solution). A dead sandbox is not: its SandboxError propagates and fails the job as
    an infrastructure fault (``failure_kind="sandbox"``), never a trained-on 0.0."""
    from sandbox import ToolError

    try:
        return (await handle.download(SOLUTION)).decode("utf-8", errors="replace")
    except ToolError:
        return None
