"""The ``code`` handler: the ``code`` task (:mod:`handlers.code.task`) with the tool agent loop as harness.

- init: start a sandbox (no network) and put the problem in ``/workspace/solution.py`` (the signature and
  docstring) for the agent to complete.
- run: the generic agent loop with ``str_replace_editor``, ``bash`` and ``ipython`` on that sandbox; the
  agent may run its own checks; afterwards ``/workspace/solution.py`` is taken as the solution (and recorded
  in the result's ``extra["solution"]``: what ``prorl-journal regrade`` grades again).
- eval: the solution runs in a FRESH sandbox of its own and the hidden tests in another one, which the solution
  never reaches; the host relays the tests' calls as plain data (:mod:`handlers.code.grading`). Reward 1.0 if
  every test passes, else 0.0; ``extra["eval"]`` says which test failed, the error, or that a time limit was
  hit. A failure of the grader's sandbox raises :class:`~handlers.code.grading.GraderError` (the eval stage
  fails). That score is the ``outcome`` component; the process terms ``tool_call_errors`` and ``language_mixing``
  (:mod:`prorl_server.rewards`, weight 0 unless the request's ``reward_weights`` names them) are added to it.

Settings (``handlers: {code: {max_turns, eval_timeout_s, eval_call_timeout_s}}``,
:class:`~handlers.code.task.CodeSettings`) give the defaults an instance may override.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from handlers.code.task import (DEFAULT_EVAL_TIMEOUT_S, SOLUTION, CodeInstance, CodeSettings, evaluate_solution,
                                grading_limits, instance_by_id, sandbox_spec)
from prorl_server.plugin import AgentConfig, AgentHandler, NotRegradableError
from prorl_server.plugin.toolkit import run_agent, sandbox_tools
from prorl_server.plugin import STANDARD_TERMS, compose_reward, process_terms_async
from sandbox import ToolError

__all__ = ["CodeHandler", "DEFAULT_EVAL_TIMEOUT_S", "SOLUTION", "evaluate_solution", "sandbox_spec"]

SYSTEM_PROMPT = ("You are a careful Python programmer working in /workspace. Use the tools to write and test "
                 "code. When the solution is complete, call the finish tool.")
USER_TEMPLATE = ("Complete the function below. The file /workspace/{solution} already holds its signature and "
                 "docstring; write the full implementation there (the signature included), test it if you "
                 "like, then call finish.\n\n```python\n{prompt}```")



@dataclass(slots=True)
class CodeState:
    """What a ``code`` job carries between stages (``job.state``)."""

    sandbox: Any = None  # the run sandbox, with the prompt in the solution file
    solution: Optional[str] = None  # the solution file the agent left (None: it wrote none); eval grades it

class CodeHandler(AgentHandler):
    """Instance: :class:`~handlers.code.task.CodeInstance` (``{"data_source": "code", "prompt", "tests",
    "entry_point"}``, HumanEval or inline, or ``{"data_source": "code", "instance_id": "HumanEval/0"}``);
    optional ``max_turns``, ``eval_timeout_s`` and ``eval_call_timeout_s`` override the settings."""

    name = "code"
    needs_sandbox = True
    aliases = ("humaneval",)
    needs_llm = True
    instance_model = CodeInstance
    settings_model = CodeSettings
    state_model = CodeState
    reward_terms = STANDARD_TERMS  # tool-call parse errors, language mixing: weight 0 unless the request asks

    def instance_by_id(self, instance_id: str) -> Optional[dict[str, Any]]:
        return instance_by_id(instance_id)

    async def init(self, job) -> None:
        handle = await job.open_sandbox(sandbox_spec())
        await handle.upload(SOLUTION, job.instance["prompt"].encode())
        job.state.sandbox = handle

    async def run(self, job) -> None:
        handle = job.state.sandbox
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": USER_TEMPLATE.format(solution=SOLUTION,
                                                                     prompt=job.instance["prompt"])}]
        tools = sandbox_tools(handle, ("str_replace_editor", "bash", "ipython"))
        max_turns = job.instance.get("max_turns") or self.settings.max_turns
        try:
            await run_agent(job, messages, tools, AgentConfig(max_turns=int(max_turns)))
        finally:
            # Whatever happened, keep what the agent wrote: eval scores the file, not the conversation. The
            # result records it too (None: no file), so the graded artifact can be graded again.
            job.state.solution = job.extra["solution"] = await _read_solution(handle)

    def restore_for_eval(self, job, result) -> None:
        """The solution file :meth:`run` read back from the sandbox, recorded in ``extra["solution"]`` (None:
        the agent wrote none)."""
        if "solution" not in result.extra:
            raise NotRegradableError("the result has no extra.solution (recorded by a server whose code handler did "
                                     "not keep the graded file): the solution only existed in the run sandbox")
        solution = result.extra["solution"]
        if solution is not None and not isinstance(solution, str):
            raise NotRegradableError("extra.solution is not a string")
        job.state.solution = solution

    async def eval(self, job) -> None:
        limits = grading_limits(job.instance, self.settings)
        reward, info = await evaluate_solution(job.open_sandbox, job.instance, job.state.solution,
                                               limits.timeout_s, limits.call_timeout_s)
        job.resolved = reward == 1.0
        compose_reward(job, reward, await process_terms_async(job))  # the outcome, plus the opted-in process terms
        job.extra["eval"] = info


#: Largest solution file read back from the sandbox, bytes (the host decodes it: bounded, I4). A HumanEval
#: solution is a few kilobytes.
MAX_SOLUTION_BYTES = 1 << 20


async def _read_solution(handle) -> Optional[str]:
    """The agent's solution file, or None when it wrote none (a missing or unreadable file, or one over
    :data:`MAX_SOLUTION_BYTES`, is the agent's doing: graded as no solution). A dead sandbox propagates its
    SandboxError: after the model acted, a scored ``model_crashed_sandbox`` (:mod:`prorl_server.failures`)."""
    try:
        return (await handle.download(SOLUTION, max_bytes=MAX_SOLUTION_BYTES)).decode("utf-8", errors="replace")
    except ToolError:
        return None
