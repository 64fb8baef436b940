"""The ``math`` handler.

- init: start a sandbox (no network) for the agent's IPython kernel (started lazily on first use).
- run: the generic agent loop with ``ipython`` and ``think``; the agent ends with the finish tool, whose
  ``answer`` (else the last assistant message) is the final answer text.
- eval: reward from the last ``\\boxed{}`` of that text: math-verify against ``answer`` for inline instances,
  reasoning-gym's own ``score_answer`` for reasoning-gym instances (see :mod:`handlers.math.scoring`).
  ``resolved`` = reward 1.0. Scoring is CPU-bound: it runs in the server's CPU process pool
  (``job.run_cpu``), never on the event loop; an answer whose scoring runs past
  ``MathHandler.score_timeout_s`` scores 0.0 (the worker is replaced); a worker that dies scoring the answer
  is the answer's doing: reward 0.0, ``failure_kind="model_crashed_grader"``, not filtered (who acted
  decides: :mod:`prorl_server.failures`). That score is the ``outcome`` component; the process terms
  ``tool_call_errors`` and ``language_mixing`` (:mod:`prorl_server.rewards`, penalties in [-1, 0], weight 0
  unless the request's ``reward_weights`` names them) are added to ``reward``, never to ``resolved``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from handlers.math.rg_answers import task_error
from handlers.math.scoring import score
from prorl_server.cpu_pool import CpuTimeoutError, WorkerCrashedError
from prorl_server.plugin import AgentConfig, AgentHandler, NotRegradableError
from prorl_server.plugin.toolkit import run_agent, sandbox_tools
from prorl_server.plugin import STANDARD_TERMS, compose_reward, process_terms_async
from sandbox import Limits, SandboxSpec

SYSTEM_PROMPT = ("Solve the problem. You may compute with the ipython tool and reason with the think tool. "
                 "Call finish with your final answer written as \\boxed{...}.")


DEFAULT_MAX_TURNS = 6


def final_answer(answer: Optional[dict[str, Any]], messages: list[dict[str, Any]]) -> str:
    """The text eval scores: the finish tool's ``answer`` argument (``answer`` is the finish call's arguments,
    None when the agent never called it), else the last assistant message's content, else ""."""
    final = answer.get("answer") if isinstance(answer, dict) else None
    if final is None:
        final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    return str(final)


def _scalar(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("must be a string or a number")
    return value


Scalar = Annotated[Any, AfterValidator(_scalar)]


class MathInstance(BaseModel):
    """``{"data_source": "math", "question", "answer"}`` (strings or numbers), ``rg_entry`` for a
    reasoning-gym problem, optional ``max_turns``; other keys are allowed."""

    model_config = ConfigDict(extra="allow")

    question: Scalar = Field(description="the problem the model sees")
    answer: Scalar = Field(description="the gold answer (math-verify parses it)")
    rg_entry: Optional[dict[str, Any]] = Field(default=None, description="reasoning-gym's entry: scored with "
                                               "that task's own score_answer")
    max_turns: Optional[int] = Field(default=None, ge=1, description="agent turns (default: the setting)")

    @field_validator("rg_entry")
    @classmethod
    def _served_task(cls, entry: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if entry is None:
            return entry
        metadata = entry.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("source_dataset"), str):
            raise ValueError("must carry metadata.source_dataset (reasoning-gym's entry as generated)")
        error = task_error(metadata["source_dataset"])
        if error is not None:
            raise ValueError(error)
        return entry


class MathSettings(BaseModel):
    """The ``math`` handler's settings (``handlers: {math: {...}}``)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=DEFAULT_MAX_TURNS, ge=1, description="agent turns for an instance that "
                           "sets none")


@dataclass(slots=True)
class MathState:
    """What a ``math`` job carries between stages (``job.state``)."""

    sandbox: Any = None  # the agent's sandbox (IPython), opened in init
    final_answer: str = ""  # the answer run extracted; eval scores it


class MathHandler(AgentHandler):
    """Instance: :class:`MathInstance`; optional ``max_turns`` (default: the ``max_turns`` setting, 6)."""

    name = "math"
    needs_sandbox = True
    aliases = ("reasoning_gym", "reasoning-gym")
    needs_llm = True
    instance_model = MathInstance
    settings_model = MathSettings
    state_model = MathState
    reward_terms = STANDARD_TERMS  # tool-call parse errors, language mixing: weight 0 unless the request asks

    async def init(self, job) -> None:
        job.state.sandbox = await job.open_sandbox(
            SandboxSpec(network="none", limits=Limits(max_processes=256, max_memory_bytes=8 << 30)))

    async def run(self, job) -> None:
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": str(job.instance["question"])}]
        max_turns = job.instance.get("max_turns") or self.settings.max_turns
        result = await run_agent(job, messages, sandbox_tools(job.state.sandbox, ("ipython", "think")),
                                 AgentConfig(max_turns=int(max_turns)))
        job.state.final_answer = final_answer(result.answer, result.messages)

    def restore_for_eval(self, job, result) -> None:
        """The final answer, rebuilt as :meth:`run` made it: the finish tool's arguments are recorded in
        ``extra["agent"]["answer"]`` (:meth:`AgentResult.apply_to`), the messages in ``messages``."""
        agent = result.extra.get("agent")
        if not isinstance(agent, dict) or "answer" not in agent:
            raise NotRegradableError("the result has no extra.agent.answer (the agent loop's record of the finish "
                                     "tool): its final answer cannot be rebuilt")
        job.state.final_answer = final_answer(agent["answer"], result.messages)

    #: Wall-clock limit of scoring one answer in a CPU worker, seconds. math-verify's own limits (5 s to parse
    #: each side, 5 s per comparison) end a slow answer well before; this one also ends a scorer stuck in C.
    score_timeout_s: float = 30.0

    async def eval(self, job) -> None:
        try:
            reward, info = await job.run_cpu(score, job.instance, job.state.final_answer,
                                             timeout_s=self.score_timeout_s)
        except CpuTimeoutError as e:
            # The answer made the scorer run past its limit or its job's CPU budget (job.run_cpu): the answer's
            # doing, so a 0.0, not a failure.
            reward, info = 0.0, {"reason": f"scoring ran past {self.score_timeout_s:g} s or the answer's CPU budget "
                                           f"(an answer too costly to verify): {e}"}
        except WorkerCrashedError as e:
            # The worker died scoring this answer: what the answer caused is scored, never re-rolled.
            job.extra["eval"] = {"reason": f"the scoring worker died on the answer: {e}"}
            job.reward, job.resolved = 0.0, False
            job.failure_kind = "model_crashed_grader" if job.model_acted else "harness"
            job.error = f"eval: the scoring worker died on the answer ({e})"
            return
        except Exception as e:  # the scorer raised on the answer: its 0.0
            reward, info = 0.0, {"reason": f"scoring raised {type(e).__name__} on the answer"}
        job.resolved = reward >= 1.0
        compose_reward(job, reward, await process_terms_async(job))  # the outcome, plus the opted-in process terms
        job.extra["eval"] = info
