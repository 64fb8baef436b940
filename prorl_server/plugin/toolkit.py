"""Agent-facing tools over a sandbox: OpenAI tool schemas bound to a :class:`sandbox.SandboxHandle`, in the
``name -> (schema, async fn)`` form :class:`prorl_server.llm.agent_loop.AgentLoop` takes, and the one helper every
LLM handler uses to run its agent loop.

The schemas follow the SWE-agent / OpenHands conventions (``bash``, ``str_replace_editor`` with
view/create/str_replace/insert/undo_edit) plus ``ipython`` and ``think``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from prorl_server.llm.agent_loop import (AgentConfig, AgentLoop, AgentResult, ToolSpec, parallel_safe,
                                         tool_time_left)

__all__ = ["AgentConfig", "run_agent", "sandbox_tools"]

if TYPE_CHECKING:
    from prorl_server.job import Job

BASH = {"name": "bash", "description": "Run a bash command in a persistent shell (cwd and variables persist). "
        "Returns its output and exit code.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The command to run."}}, "required": ["command"]}}
IPYTHON = {"name": "ipython", "description": "Run Python code in a persistent IPython kernel; returns the "
           "printed output and the value of the last expression.",
           "parameters": {"type": "object", "properties": {
               "code": {"type": "string", "description": "Python code to execute."}}, "required": ["code"]}}
EDITOR = {"name": "str_replace_editor", "description": "View, create and edit files in the workspace. "
          "Commands: view (a file with line numbers or a directory), create (a new file with file_text), "
          "str_replace (replace the unique occurrence of old_str with new_str), insert (new_str after line "
          "insert_line), undo_edit (revert the last edit of path).",
          "parameters": {"type": "object", "properties": {
              "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
              "path": {"type": "string", "description": "Absolute path, or relative to the workspace."},
              "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
              "insert_line": {"type": "integer"},
              "view_range": {"type": "array", "items": {"type": "integer"}}},
              "required": ["command", "path"]}}
THINK = {"name": "think", "description": "Write down your reasoning. It changes nothing and returns nothing.",
         "parameters": {"type": "object", "properties": {"thought": {"type": "string"}}, "required": ["thought"]}}

EDITOR_KEYS = ("file_text", "old_str", "new_str", "insert_line", "view_range")
DEADLINE_MARGIN_S = 1.0
"""Seconds before the job's deadline at which a clamped command is stopped (room to report it)."""
MIN_COMMAND_S = 0.1
"""Shortest limit a clamped command gets, seconds."""


def _clamped(limit_s: float) -> float:
    """``limit_s`` clamped to the job's time left (inside the agent loop's tool call), seconds."""
    left = tool_time_left()
    return limit_s if left is None else max(MIN_COMMAND_S, min(limit_s, left - DEADLINE_MARGIN_S))


def sandbox_tools(handle: Any, names: Iterable[str] = ("bash", "ipython", "str_replace_editor"),
                  bash_timeout_s: float = 60.0, ipython_timeout_s: float = 60.0) -> dict[str, "ToolSpec"]:
    """Tools named in ``names`` bound to ``handle`` (plus ``think`` if named).

    What the model caused reaches it as an observation: a command past ``bash_timeout_s`` /
    ``ipython_timeout_s`` (seconds) returns its partial output marked ``[timed out]``, and a
    :class:`sandbox.errors.ToolError` (a path outside the workspace, a non-unique ``str_replace``, a killed
    kernel) becomes an error observation in the agent loop. Nothing here catches a sandbox error
    (``SandboxDeadError``, ``ToolTimeout``: the execution server did not answer, ``ProtocolError``): it
    propagates and ends the job, scored 0.0 as ``model_crashed_sandbox`` / ``model_stalled_sandbox`` since
    the model acted (:mod:`prorl_server.failures`). ``bash`` and ``ipython``
    carry their limit as ``fn.timeout_s``, so the agent loop's ``tool_timeout_s`` never fires before it. Both
    limits are clamped to what is left of the job's time budget (:func:`~prorl_server.llm.agent_loop.tool_time_left`
    minus :data:`DEADLINE_MARGIN_S`), so a command the model keeps busy ends as its own ``[timed out]``."""

    async def bash(args: dict) -> str:
        r = await handle.bash(str(args.get("command", "")), timeout_s=_clamped(bash_timeout_s))
        status = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        return f"{r.output}\n[{status}]"

    async def ipython(args: dict) -> str:
        r = await handle.ipython(str(args.get("code", "")), timeout_s=_clamped(ipython_timeout_s))
        parts = [r.text] if r.text else []
        if r.images:
            parts.append(f"[{len(r.images)} image(s)]")
        if r.error:
            parts.append(r.error)
        return "\n".join(parts) or "[no output]"

    async def editor(args: dict) -> str:
        kw = {k: args[k] for k in EDITOR_KEYS if k in args}
        return (await handle.editor(str(args.get("command", "")), str(args.get("path", "")), **kw)).output

    @parallel_safe  # touches no state: it may run beside other calls (AgentConfig.parallel_tool_calls)
    async def think(args: dict) -> str:
        return "OK."

    bash.timeout_s = bash_timeout_s  # type: ignore[attr-defined]
    ipython.timeout_s = ipython_timeout_s  # type: ignore[attr-defined]

    table = {"bash": (BASH, bash), "ipython": (IPYTHON, ipython), "str_replace_editor": (EDITOR, editor),
             "think": (THINK, think)}
    return {n: table[n] for n in names}


async def run_agent(job: "Job", messages: list[dict], tools: dict[str, "ToolSpec"],
                    config: Optional["AgentConfig"] = None) -> "AgentResult":
    """Run the generic agent loop for ``job`` on its sticky backend with the server's shared client and the
    served model's tokenizer; writes messages, trajectories and agent metrics into the job.

    Raises:
        RuntimeError: the server has no LLM context.
        prorl_server.llm.client.LLMUnavailableError: no backend could generate (the stage fails: ``run``,
            ``failure_kind="llm_backend"``).
        sandbox.errors.SandboxError: a tool's sandbox failed or stopped answering (never a ``ToolError``, which
            the model sees as an observation): ``failure_kind="sandbox"`` before the model's first turn,
            ``model_crashed_sandbox`` / ``model_stalled_sandbox`` (scored 0.0) after it.

    Whatever it raises, the conversation so far (if a turn was generated) is written into the job first. Tool
    limits are clamped to the job's remaining ``timeout_s``.
    """
    if job.llm is None:
        raise RuntimeError("this server has no LLM context")
    backend = await job.backend()
    tokenizer = await job.llm.tokenizer(backend)
    loop = AgentLoop(tokenizer, job.llm.client, tools, config)
    try:
        result = await loop.run(messages, backend=job, sampling_params=job.sampling_params,
                                time_budget_s=job.remaining_s())
    except BaseException as e:
        # Whoever caused it, keep what the model did: a failure of its making is scored on these trajectories
        # (prorl_server.failures), one outside its reach is filtered with them visible.
        partial = getattr(e, "agent_result", None)
        if isinstance(partial, AgentResult):
            partial.apply_to(job)
        raise
    result.apply_to(job)
    return result
