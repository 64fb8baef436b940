"""A generic tool-using agent loop over the token-in/token-out client; handlers reuse it.

Each turn: generate from the conversation's exact token ids (:class:`~prorl_server.llm_client.LLMClient`),
append the generated tokens as-is (:class:`~prorl_server.conversation.Conversation`), parse tool calls from
the text (:mod:`prorl_server.tool_parser`, hermes by default), run them in order, append their observations
(only those are tokenized) and go on, until a stop condition:

- ``"stop"``: the model called the finish tool (its arguments are ``AgentResult.answer``);
- ``"no_tool_call"``: the turn called no tool (with ``stop_on_no_tool_call``; otherwise a user nudge is
  appended and the loop goes on);
- ``"length"``: the context is full, a turn was cut by ``max_tokens`` without a tool call, or the next
  observation would not fit;
- ``"max_turns"``: ``max_turns`` turns were generated (the last turn's tool calls are not run).

Tools are a mapping ``name -> (JSON schema, async fn(arguments: dict) -> str)``; the schemas reach the model
through the chat template's ``tools=`` support (the system prompt the model was trained with). Sandbox tools
(bash, ipython, str_replace_editor) plug in the same way.

What the model caused and what it did not (issue 14: infrastructure faults are never training data):

- **Observations** (the model sees them and is trained on them; counted in the metrics): a malformed call,
  an unknown tool, a :class:`sandbox.errors.ToolError` (an editor path outside the workspace, a
  ``str_replace`` that is not unique, a kernel its code killed), any other exception of a tool function
  (bad arguments), and the model's own command running past its time limit (bash/ipython return that as
  ``timed_out`` output, not as an exception).
- **Failures** (the exception propagates, the run stage fails, the job gets ``failure_kind`` and
  ``filter: true``): every other :class:`sandbox.errors.SandboxError` (the sandbox could not start, died, or
  its execution server stopped answering: ``SandboxDeadError``, ``SandboxStartError``, ``ProtocolError``,
  ``ToolTimeout``), an :class:`~prorl_server.failures.InfrastructureError` a tool raises, and a tool that
  gives no answer within ``AgentConfig.tool_timeout_s``: the tools' own limits (bash/ipython ``timeout_s``)
  report a slow command as output well before that, so reaching it means the tool or its sandbox is not
  answering (raised as :class:`sandbox.errors.ToolTimeout`, ``failure_kind="sandbox"``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional, Sequence

from prorl_server.conversation import Conversation
from prorl_server.failures import InfrastructureError
from prorl_server.llm_client import BackendSource, LLMClient, backend_getter
from prorl_server.tool_parser import ParsedTurn, ToolCall, ToolCallError, ToolParser, get_parser
from prorl_server.types import Trajectory
from sandbox.errors import SandboxError, ToolError, ToolTimeout

if TYPE_CHECKING:
    from prorl_server.job import Job

log = logging.getLogger(__name__)

ToolFn = Callable[[dict], Awaitable[Any]]
ToolSpec = tuple[dict, Optional[ToolFn]]
"""``(schema, fn)``: ``schema`` is an OpenAI tool (``{"type": "function", "function": {...}}``), a function
object (``{"name", "description", "parameters"}``) or a bare JSON schema of the arguments; ``fn`` is awaited
with the parsed arguments and returns the observation (``str()`` is applied). ``fn`` may be None only for
the finish tool."""

FINISH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "finish",
        "description": "Call this once the task is complete, with your final answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string",
                                                                   "description": "The final answer."}},
                       "required": ["answer"]},
    },
}


TOOL_GRACE_S = 30.0
"""Seconds a tool with its own ``timeout_s`` gets beyond it before the loop treats it as not answering."""


@dataclass
class AgentConfig:
    """Stop conditions and limits of :class:`AgentLoop` (token counts in tokens, times in seconds).

    ``max_context_tokens``: cap on prompt + all turns; the effective limit is the smallest of this, the
    backend's ``max_model_len`` and the tokenizer's ``model_max_length``. ``max_tokens_per_turn``: default
    ``sampling_params["max_tokens"]``, else whatever room is left. ``finish_tool``: name of the tool that ends
    the rollout (added with :data:`FINISH_SCHEMA` if the tools do not define it; None: no finish tool).
    ``max_observation_chars``: longer tool outputs are cut (None: never). ``tool_timeout_s``: a tool call
    that has not answered by then fails the rollout as an infrastructure fault (see the module docstring);
    a tool function with a ``timeout_s`` attribute (its own limit on the model's work, which it reports as
    output) gets at least that plus :data:`TOOL_GRACE_S` (None: no limit).
    """

    max_turns: int = 16
    max_context_tokens: Optional[int] = None
    max_tokens_per_turn: Optional[int] = None
    finish_tool: Optional[str] = "finish"
    stop_on_no_tool_call: bool = True
    no_tool_call_message: str = ("No tool was called. Call one of the tools, or call the finish tool when "
                                 "the task is complete.")
    tool_timeout_s: Optional[float] = 300.0
    max_observation_chars: Optional[int] = None
    parser: "str | ToolParser" = "hermes"
    window: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    llm_timeout_s: Optional[float] = None


@dataclass
class AgentResult:
    """Outcome of one rollout.

    ``messages``: the conversation (assistant ``content`` is the generated text verbatim; ``tool_calls`` is
    added for information; the observations of the turn that ended the rollout, e.g. the finish tool's, are
    not appended, so messages and tokens stay in step). ``trajectories``: token-level segments (one unless the template forced a split).
    ``metrics``: counters (``tool_calls``, ``tool_errors``, ``malformed_tool_calls``, ``unknown_tool_calls``,
    ``tool_timeouts``, ``llm_failovers``, ``llm_pause_retries``, ``splits``, ...) and seconds
    (``llm_http_s``, ``tool_s``, ``overhead_s`` = everything else the loop spent).
    """

    messages: list[dict]
    trajectories: list[Trajectory]
    finish_reason: str
    num_turns: int
    answer: Optional[dict] = None
    weight_versions: list[int] = field(default_factory=list)
    backend: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)

    def apply_to(self, job: "Job") -> None:
        """Write messages, trajectories and metrics into a job (``job.extra["agent"]``)."""
        job.messages = self.messages
        job.trajectories = self.trajectories
        job.extra["agent"] = {"finish_reason": self.finish_reason, "num_turns": self.num_turns,
                              "answer": self.answer, "weight_versions": self.weight_versions, **self.metrics}


def tool_schema(name: str, schema: dict) -> dict:
    """Normalise a tool description to the OpenAI ``{"type": "function", "function": {...}}`` form."""
    if schema.get("type") == "function" and "function" in schema:
        return schema
    if "parameters" in schema:
        return {"type": "function", "function": {"name": name, **schema}}
    params = {k: v for k, v in schema.items() if k != "description"}
    return {"type": "function", "function": {"name": name, "description": schema.get("description", ""),
                                             "parameters": params}}


class AgentLoop:
    """Runs rollouts with one tokenizer, client and tool set (reusable, safe to run concurrently).

    Args:
        tokenizer: the model's transformers tokenizer (its chat template is used).
        llm: the shared :class:`LLMClient`.
        tools: ``name -> (schema, async fn)``, see :data:`ToolSpec`.
        config: :class:`AgentConfig`.

    ``counters`` accumulates the per-run metrics over all runs (for ``/metrics``).
    """

    def __init__(self, tokenizer: Any, llm: LLMClient, tools: Optional[Mapping[str, ToolSpec]] = None,
                 config: Optional[AgentConfig] = None) -> None:
        self.tokenizer = tokenizer
        self.llm = llm
        self.config = config or AgentConfig()
        self.tools: dict[str, ToolSpec] = dict(tools or {})
        if self.config.finish_tool and self.config.finish_tool not in self.tools:
            schema = {"type": "function", "function": {**FINISH_SCHEMA["function"], "name": self.config.finish_tool}}
            self.tools[self.config.finish_tool] = (schema, None)
        for name, (_, fn) in self.tools.items():
            if fn is None and name != self.config.finish_tool:
                raise ValueError(f"tool {name!r} has no function")
        self.schemas = [tool_schema(name, schema) for name, (schema, _) in self.tools.items()]
        self.parser = get_parser(self.config.parser)
        self.counters: dict[str, float] = {}

    async def run(self, messages: Sequence[dict], *, backend: BackendSource,
                  sampling_params: Optional[dict[str, Any]] = None) -> AgentResult:
        """One rollout from ``messages`` (system/user, OpenAI format).

        Args:
            backend: where to generate: a :class:`~prorl_server.job.Job` (its sticky backend, failover via
                ``job.backend(exclude=...)``), a Backend, a base URL, or an ``async (exclude) -> Backend``.
            sampling_params: passed to vLLM each turn (``max_tokens`` is the per-turn limit).

        Raises:
            LLMUnavailableError: no backend could generate a turn (the pipeline reports
                ``critical_error="run"``); nothing partial is kept from the failed turn.
            ContextLengthError: the initial prompt does not fit.
            sandbox.errors.SandboxError: a tool's sandbox failed (not a ``ToolError``), or a tool gave no
                answer within ``tool_timeout_s`` (``ToolTimeout``); InfrastructureError: a tool raised one.
                The rollout is not returned: it must not be trained on.
        """
        t_start = time.perf_counter()
        cfg = self.config
        sp = dict(sampling_params or {})
        per_turn = cfg.max_tokens_per_turn or sp.pop("max_tokens", None)
        sp.pop("max_tokens", None)
        get = backend_getter(backend)
        m: dict[str, float] = {k: 0 for k in ("tool_calls", "tool_errors", "malformed_tool_calls",
                                                "unknown_tool_calls", "tool_timeouts", "llm_calls",
                                                "llm_failovers", "llm_pause_retries")}
        m.update(llm_http_s=0.0, tool_s=0.0)

        ctx = await self._context_limit(get)
        conv = await Conversation.create(self.tokenizer, messages, max_context_tokens=ctx, tools=self.schemas,
                                         chat_template_kwargs=cfg.chat_template_kwargs, window=cfg.window)
        finish_reason = "max_turns"
        answer: Optional[dict] = None
        backend_address: Optional[str] = None
        while conv.num_turns < cfg.max_turns:
            room = conv.room
            if room < 1:
                finish_reason = "length"
                break
            max_tokens = min(per_turn, room) if per_turn else room
            comp = await self.llm.complete(conv.token_ids, backend=get, max_tokens=max_tokens, sampling_params=sp,
                                           timeout_s=cfg.llm_timeout_s)
            backend_address = comp.backend
            m["llm_calls"] += 1
            m["llm_failovers"] += comp.failovers
            m["llm_pause_retries"] += comp.pause_retries
            m["llm_http_s"] += comp.http_s
            msg = conv.add_completion(comp)
            parsed = self.parser.parse(msg["content"])
            if parsed.calls:
                msg["tool_calls"] = [c.to_openai() for c in parsed.calls]
            m["malformed_tool_calls"] += len(parsed.errors)

            if not parsed.attempted:
                if comp.finish_reason == "length":
                    finish_reason = "length"
                    break
                if cfg.stop_on_no_tool_call:
                    finish_reason = "no_tool_call"
                    break
                new = [{"role": "user", "content": cfg.no_tool_call_message}]
            else:
                finish_call = next((c for c in parsed.calls if c.name == cfg.finish_tool), None)
                if finish_call is None and conv.num_turns >= cfg.max_turns:
                    finish_reason = "max_turns"
                    break
                t_tools = time.perf_counter()
                new = await self._run_tools(parsed, m)
                m["tool_s"] += time.perf_counter() - t_tools
                if finish_call is not None:
                    answer = finish_call.arguments
                    finish_reason = "stop"
                    break
            if not await conv.add_messages(new):
                finish_reason = "length"
                break
        conv.finish(finish_reason)

        trajectories = conv.trajectories()
        versions: list[int] = []
        for t in trajectories:
            versions.extend(v for v in t.weight_versions if v not in versions)
        m.update({k: v for k, v in conv.metrics.items()})
        m["turns"] = conv.num_turns
        m["overhead_s"] = time.perf_counter() - t_start - m["llm_http_s"] - m["tool_s"]
        for k, v in m.items():
            self.counters[k] = self.counters.get(k, 0) + v
        return AgentResult(messages=conv.messages, trajectories=trajectories, finish_reason=finish_reason,
                           num_turns=conv.num_turns, answer=answer, weight_versions=versions,
                           backend=backend_address, metrics=m)

    async def _context_limit(self, get) -> int:
        limits = [self.config.max_context_tokens]
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(model_max, int) and model_max < 10**8:
            limits.append(model_max)
        try:
            b = await get(frozenset())
            limits.append((await self.llm.model_info(b.address)).max_model_len)
        except Exception as e:  # e.g. the backend is down: the first generation call fails over properly
            log.debug("could not read the backend's max_model_len: %r", e)
        known = [x for x in limits if x]
        if not known:
            raise ValueError("no context length known: set AgentConfig.max_context_tokens")
        return min(known)

    async def _run_tools(self, parsed: ParsedTurn, m: dict[str, float]) -> list[dict]:
        """Run the turn's calls in text order (up to and including the finish tool); one observation each."""
        out: list[dict] = []
        for item in parsed.items:
            if isinstance(item, ToolCallError):
                out.append({"role": "tool", "tool_call_id": item.id, "name": "invalid_tool_call",
                            "content": f"Error: {item.message}. Tool calls must be "
                                       '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'})
                continue
            call: ToolCall = item
            m["tool_calls"] += 1
            obs = await self._call(call, m)
            out.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": obs})
            if call.name == self.config.finish_tool:
                break
        return out

    async def _call(self, call: ToolCall, m: dict[str, float]) -> str:
        spec = self.tools.get(call.name)
        if spec is None:
            m["unknown_tool_calls"] += 1
            return f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}"
        fn = spec[1]
        if fn is None:  # the built-in finish tool
            return "Finished."
        limit = self.config.tool_timeout_s or None
        own = getattr(fn, "timeout_s", None)
        if limit is not None and isinstance(own, (int, float)):
            limit = max(limit, own + TOOL_GRACE_S)  # never cut a tool before it reports a slow command itself
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                result = await fn(call.arguments)
        except ToolError as e:  # caused by what the model asked for: its message is meant for the model
            m["tool_errors"] += 1
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}"
        except (SandboxError, InfrastructureError):
            raise  # the sandbox, not the model: the job fails and is filtered, never an observation
        except TimeoutError as e:
            if deadline.expired():
                m["tool_timeouts"] += 1
                raise ToolTimeout(f"tool {call.name!r} gave no answer within {limit:g} s (tool_timeout_s): "
                                  "the tool or its sandbox is not answering") from e
            m["tool_errors"] += 1  # a TimeoutError of the tool's own making is like any other tool error
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}"
        except Exception as e:  # bad arguments and other tool bugs: the model's observation
            m["tool_errors"] += 1
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}"
        obs = result if isinstance(result, str) else str(result)
        limit = self.config.max_observation_chars
        if limit is not None and len(obs) > limit:
            obs = obs[:limit] + f"\n[... {len(obs) - limit} characters cut]"
        return obs
