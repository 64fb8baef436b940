"""The ``code`` task, without a harness: what an instance is, the sandbox the solution is written in, and the
scorer. The ``code`` handler drives it with the tool agent loop (:mod:`handlers.code.handler`); the
``cli_agent`` handler drives it with a black-box program through the gateway (its ``eval="code"``).

- :class:`CodeInstance`: ``{"data_source": "code", "prompt" (signature + docstring), "tests" (Python source
  defining ``check(candidate)``), "entry_point" (the function name)}``, optional ``max_turns``,
  ``eval_timeout_s``, ``eval_call_timeout_s`` (override the handler's settings for this instance);
- :func:`instance_by_id`: a HumanEval problem by task id (``HumanEval/0``);
- :func:`sandbox_spec`: the sandbox the solution is written (and run) in;
- :func:`evaluate_solution`: the scorer: the hidden tests on ``/workspace/solution.py`` with the solution and
  the tests each in a fresh sandbox of its own (:mod:`handlers.code.grading`).
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Awaitable, Callable, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from handlers.code.data import REQUIRED, humaneval_problems, to_instance
from handlers.code.grading import GradingLimits, grade
from sandbox import Limits, SandboxSpec

SOLUTION = "solution.py"
DEFAULT_MAX_TURNS = 8
DEFAULT_EVAL_TIMEOUT_S = 20.0
DEFAULT_CALL_TIMEOUT_S = 10.0
#: Longest ``prompt`` and ``tests``, characters each (HumanEval's longest are under 3,000): the grader gets both
#: in one message of at most ``plain.MAX_MESSAGE_BYTES`` (2 MiB), ASCII JSON, where one character can take
#: 12 bytes (an escaped surrogate pair), so twice this much always fits.
MAX_SOURCE_CHARS = 64 * 1024


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty string")
    return value


NonBlank = Annotated[str, AfterValidator(_not_blank)]


class CodeInstance(BaseModel):
    """A ``code`` problem (HumanEval or inline). Unknown keys are allowed (``instance_id``, a trainer's own)."""

    model_config = ConfigDict(extra="allow")

    prompt: NonBlank = Field(max_length=MAX_SOURCE_CHARS,
                             description="the function's signature and docstring, written to solution.py")
    tests: NonBlank = Field(max_length=MAX_SOURCE_CHARS, description="Python source defining check(candidate)")
    entry_point: NonBlank = Field(max_length=256, description="the function's name")
    max_turns: Optional[int] = Field(default=None, ge=1, description="agent turns (default: the handler's "
                                     "max_turns setting)")
    eval_timeout_s: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False,
                                            description="wall-clock limit of the test run, seconds")
    eval_call_timeout_s: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False,
                                                 description="limit of one call of the function, seconds")


class CodeSettings(BaseModel):
    """The ``code`` handler's settings (``handlers: {code: {...}}``): defaults for instances that set none."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=DEFAULT_MAX_TURNS, ge=1, description="agent turns of the tool loop")
    eval_timeout_s: float = Field(default=DEFAULT_EVAL_TIMEOUT_S, gt=0, description="wall-clock limit of the "
                                  "test run, seconds")
    eval_call_timeout_s: Optional[float] = Field(default=None, gt=0, description="limit of one call of the "
                                                 "function (and of loading the solution), seconds; default "
                                                 f"min(eval_timeout_s, {DEFAULT_CALL_TIMEOUT_S:g})")


def grading_limits(instance: dict[str, Any], settings: Optional[CodeSettings] = None) -> GradingLimits:
    """The time limits of grading ``instance``: its own ``eval_timeout_s`` / ``eval_call_timeout_s``, else
    ``settings``' (else :class:`CodeSettings`' defaults); the call limit never exceeds the run's."""
    settings = settings or CodeSettings()
    timeout_s = instance.get("eval_timeout_s")
    timeout_s = float(settings.eval_timeout_s if timeout_s is None else timeout_s)
    call = instance.get("eval_call_timeout_s")
    call = settings.eval_call_timeout_s if call is None else call
    return GradingLimits(timeout_s=timeout_s,
                         call_timeout_s=min(timeout_s, DEFAULT_CALL_TIMEOUT_S) if call is None else float(call))


def sandbox_spec(network: str = "none") -> SandboxSpec:
    """The sandbox the solution is written in: no network, bounded processes and memory (so a fork bomb or a
    runaway allocation in agent code or tests is contained)."""
    return SandboxSpec(network=network, limits=Limits(max_processes=512, max_memory_bytes=8 << 30,
                                                      max_file_bytes=256 << 20))


@functools.lru_cache(maxsize=1)
def _humaneval() -> dict[str, dict[str, Any]]:
    return humaneval_problems()


def instance_by_id(instance_id: str) -> Optional[dict[str, Any]]:
    """The HumanEval problem ``instance_id`` (``HumanEval/0`` ... ``HumanEval/163``) as an instance, or None.
    The problems are read once per process."""
    problem = _humaneval().get(instance_id)
    return None if problem is None else to_instance(problem)


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
        prorl_server.plugin.InvalidInstanceError: the instance's tests do not load or send what is not plain
            data.
        sandbox.SandboxError: a sandbox failed to start.
    """
    if solution is None:
        return 0.0, {"passed": False, "error": f"no {SOLUTION} was written", "failed_test": None,
                     "timed_out": False}
    if call_timeout_s is None:
        call_timeout_s = min(timeout_s, DEFAULT_CALL_TIMEOUT_S)
    return await grade(open_sandbox, instance, solution, GradingLimits(timeout_s=timeout_s,
                                                                       call_timeout_s=call_timeout_s))


__all__ = ["CodeInstance", "CodeSettings", "DEFAULT_EVAL_TIMEOUT_S", "REQUIRED", "SOLUTION", "evaluate_solution",
           "grading_limits", "instance_by_id", "sandbox_spec"]
