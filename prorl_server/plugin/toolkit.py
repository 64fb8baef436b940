"""Agent-facing tools over a sandbox: OpenAI tool schemas bound to a :class:`sandbox.SandboxHandle`, in the
``name -> (schema, async fn)`` form :class:`prorl_server.agent_loop.AgentLoop` takes, and the one helper every
LLM handler uses to run its agent loop.

The schemas follow the SWE-agent / OpenHands conventions (``bash``, ``str_replace_editor`` with
view/create/str_replace/insert/undo_edit) plus ``ipython`` and ``think``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from prorl_server.agent_loop import AgentConfig, AgentLoop, AgentResult, ToolSpec

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


def sandbox_tools(handle: Any, names: Iterable[str] = ("bash", "ipython", "str_replace_editor"),
                  bash_timeout_s: float = 60.0, ipython_timeout_s: float = 60.0) -> dict[str, "ToolSpec"]:
    """Tools named in ``names`` bound to ``handle`` (plus ``think`` if named).

    What the model caused reaches it as an observation: a command past ``bash_timeout_s`` /
    ``ipython_timeout_s`` (seconds) returns its partial output marked ``[timed out]``, and a
    :class:`sandbox.errors.ToolError` (a path outside the workspace, a non-unique ``str_replace``, a killed
    kernel) becomes an error observation in the agent loop. Nothing here catches a sandbox error: an
    infrastructure fault (``SandboxDeadError``, ``ToolTimeout``: the execution server did not answer,
    ``ProtocolError``) propagates and fails the job with ``failure_kind="sandbox"``. ``bash`` and ``ipython``
    carry their limit as ``fn.timeout_s``, so the agent loop's ``tool_timeout_s`` never fires before it."""

    async def bash(args: dict) -> str:
        r = await handle.bash(str(args.get("command", "")), timeout_s=bash_timeout_s)
        status = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        return f"{r.output}\n[{status}]"

    async def ipython(args: dict) -> str:
        r = await handle.ipython(str(args.get("code", "")), timeout_s=ipython_timeout_s)
        parts = [r.text] if r.text else []
        if r.images:
            parts.append(f"[{len(r.images)} image(s)]")
        if r.error:
            parts.append(r.error)
        return "\n".join(parts) or "[no output]"

    async def editor(args: dict) -> str:
        kw = {k: args[k] for k in EDITOR_KEYS if k in args}
        return (await handle.editor(str(args.get("command", "")), str(args.get("path", "")), **kw)).output

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
        prorl_server.llm_client.LLMUnavailableError: no backend could generate (the stage fails: ``run``,
            ``failure_kind="llm_backend"``).
        sandbox.errors.SandboxError: a tool's sandbox failed or stopped answering (``failure_kind="sandbox"``;
            never a ``ToolError``, which the model sees as an observation).
    """
    if job.llm is None:
        raise RuntimeError("this server has no LLM context")
    backend = await job.backend()
    tokenizer = await job.llm.tokenizer(backend)
    loop = AgentLoop(tokenizer, job.llm.client, tools, config)
    result = await loop.run(messages, backend=job, sampling_params=job.sampling_params)
    result.apply_to(job)
    return result
