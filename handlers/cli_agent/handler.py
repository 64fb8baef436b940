"""The ``cli_agent`` handler: a black-box agent program in a sandbox, its LLM calls recorded by the gateway.

- init: a sandbox with no network (``network="none"``) and a host directory bound read-only at
  ``/run/prorl-gateway`` holding the relay launcher; the instance's ``files`` are written to the workspace
  (and, for ``eval="code"``, the problem's prompt to ``/workspace/solution.py``).
- run: a gateway session bound to the job (its sticky backend) is served on a Unix socket in that directory,
  for that session alone (:meth:`prorl_server.gateway.Gateway.serve_unix`); the agent ``command`` runs in the
  sandbox under :mod:`handlers.cli_agent.launcher`, which relays a loopback port to the socket and sets
  ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``PRORL_SESSION_URL``. The run ends when the process exits or the
  agent posts ``$PRORL_SESSION_URL/complete`` (then the process gets ``complete_grace_s`` to exit before the
  sandbox is closed). Every trajectory of the session goes into the result.
- eval: ``"code"``: the ``code`` handler's hidden tests on ``/workspace/solution.py`` in a fresh sandbox;
  ``"reward_info"``: ``reward_info["reward"]`` as posted with ``/complete``; ``"none"``: 0.0.

Why a Unix socket and not ``network="loopback"``: a loopback sandbox shares the host's network namespace
(rootless runtimes cannot filter it), so the agent could reach the rollout server's management API, other
sessions and the internet. With ``none`` its only way out is one socket that answers for its own session.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional

from handlers.base import AgentHandler

GATEWAY_DIR = "/run/prorl-gateway"
SOCKET_NAME = "gateway.sock"
LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.py").read_text()
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_COMPLETE_GRACE_S = 5.0
SOLUTION = "solution.py"
EVAL_MODES = ("code", "reward_info", "none")


def _eval_mode(instance: dict[str, Any], default: Optional[str]) -> str:
    mode = instance.get("eval", default)
    if mode is None:
        mode = "code" if all(k in instance for k in ("tests", "entry_point", "prompt")) else "reward_info"
    if mode not in EVAL_MODES:
        raise ValueError(f"cli_agent: eval must be one of {EVAL_MODES}, got {mode!r}")
    return mode


def _read_workspace_file(workspace: str, name: str, max_bytes: int = 8 << 20) -> Optional[str]:
    """A regular file of the sandbox's workspace, read on the host without following a symlink the agent may
    have planted there."""
    try:
        fd = os.open(os.path.join(workspace, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(max_bytes).decode("utf-8", errors="replace")


class CliAgentHandler(AgentHandler):
    """Instance: ``{"data_source": "cli_agent", "command": "<shell command run in /workspace>",
    "files"?: {path: text}, "env"?: {name: value}, "eval"?: "code" | "reward_info" | "none",
    "agent_timeout_s"?: 600, "complete_grace_s"?: 5}``, plus ``prompt``/``tests``/``entry_point`` (and
    ``eval_timeout_s``) for ``eval="code"`` (the default when they are given).

    Args:
        command: default agent command for instances that give none (handler config).
        eval: default eval mode.
        sandbox_image: image for the agent's sandbox (None: the server's default); it needs ``python3``.
    """

    name = "cli_agent"
    aliases = ("cli-agent", "black_box")
    needs_llm = True

    def __init__(self, command: Optional[str] = None, eval: Optional[str] = None,
                 sandbox_image: Optional[str] = None) -> None:
        self.command = command
        self.eval_mode = eval
        self.sandbox_image = sandbox_image

    async def init(self, job) -> None:
        from handlers.code.handler import sandbox_spec

        inst = job.instance
        command = inst.get("command") or self.command
        if not isinstance(command, str) or not command.strip():
            raise ValueError("cli_agent instance needs a non-empty string 'command' (or a handler default)")
        mode = _eval_mode(inst, self.eval_mode)
        if mode == "code":
            from handlers.code.data import validate_instance

            validate_instance(inst)
        files = inst.get("files") or {}
        env = inst.get("env") or {}
        if not isinstance(files, dict) or not isinstance(env, dict):
            raise ValueError("cli_agent: 'files' and 'env' must be objects")

        gw_dir = await asyncio.to_thread(tempfile.mkdtemp, prefix="prorl-gw-")
        job.add_closer(lambda: asyncio.to_thread(shutil.rmtree, gw_dir, True), "run")
        os.chmod(gw_dir, 0o755)  # a root server's sandbox runs as an unprivileged uid of its own
        Path(gw_dir, "launcher.py").write_text(LAUNCHER_SOURCE)
        spec = sandbox_spec()
        spec.binds = [*spec.binds, *_binds(gw_dir)]
        spec.env = {str(k): str(v) for k, v in env.items()}
        if self.sandbox_image:
            spec.image = self.sandbox_image
        handle = await job.open_sandbox(spec)
        for path, text in files.items():
            await handle.upload(str(path), str(text).encode())
        if mode == "code":
            await handle.upload(SOLUTION, inst["prompt"].encode())
        job.state.update(sandbox=handle, gateway_dir=gw_dir, command=command, eval=mode)

    async def run(self, job) -> None:
        from prorl_server.gateway import gateway_for

        inst = job.instance
        handle = job.state["sandbox"]
        gw = gateway_for(job)
        session = gw.create_session(job=job, metadata={"job_id": job.job_id, "instance_id": job.instance_id})
        job.add_closer(_abort_if_open(gw, session), "run")
        runner = await gw.serve_unix(session, os.path.join(job.state["gateway_dir"], SOCKET_NAME))
        job.add_closer(runner.cleanup, "run")
        argv = ["python3", f"{GATEWAY_DIR}/launcher.py", f"{GATEWAY_DIR}/{SOCKET_NAME}", f"/sessions/{session.ref}",
                "--", "bash", "-c", job.state["command"]]
        timeout_s = float(inst.get("agent_timeout_s", DEFAULT_AGENT_TIMEOUT_S))
        agent = asyncio.ensure_future(handle.bash(" ".join(shlex.quote(a) for a in argv), timeout_s=timeout_s))
        completed = asyncio.ensure_future(session.completed.wait())
        try:
            await asyncio.wait({agent, completed}, return_when=asyncio.FIRST_COMPLETED)
            if not agent.done():  # completed by /complete: the process gets a grace period to exit
                grace = float(inst.get("complete_grace_s", DEFAULT_COMPLETE_GRACE_S))
                await asyncio.wait({agent}, timeout=grace)
        except BaseException:  # cancelled or timed out: the sandbox closes, the tool call goes with it
            agent.cancel()
            raise
        finally:
            completed.cancel()
        info: dict[str, Any] = {"exit_code": None, "timed_out": False, "output_tail": None}
        if agent.done():
            r = agent.result()
            info.update(exit_code=r.exit_code, timed_out=r.timed_out, output_tail=r.output[-4000:])
            end = "agent_timeout" if r.timed_out else "exit"
        else:  # still running after /complete and the grace period: closing the sandbox ends it
            agent.cancel()
            with contextlib.suppress(BaseException):
                await agent
            end = "complete"
        if job.state["eval"] == "code":
            job.state["solution"] = await asyncio.to_thread(_read_workspace_file, handle.workspace, SOLUTION)
        result = gw.finalize(session, reason=end)
        job.trajectories = session.trajectories()
        job.messages = result["messages"]
        job.state["reward_info"] = session.reward_info
        job.extra["gateway"] = {**session.summary(), **info}

    async def eval(self, job) -> None:
        mode = job.state.get("eval")
        if mode == "code":
            from handlers.code.handler import DEFAULT_EVAL_TIMEOUT_S, evaluate_solution

            reward, info = await evaluate_solution(
                job.open_sandbox, job.instance, job.state.get("solution"),
                float(job.instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)))
            job.reward, job.resolved = reward, reward == 1.0
            job.extra["eval"] = info
        elif mode == "reward_info":
            info = job.state.get("reward_info") or {}
            value = info.get("reward", 0.0)
            job.reward = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
            job.resolved = bool(info.get("resolved", job.reward >= 1.0))
            job.extra["eval"] = {"reward_info": info}


def _binds(gw_dir: str) -> list[Any]:
    from sandbox import Bind

    return [Bind(host=gw_dir, container=GATEWAY_DIR, ro=True)]


def _abort_if_open(gw, session):
    async def close() -> None:
        if session.is_open:  # the run failed or was cancelled before finalize: free the session
            gw.abort(session, "run_ended")

    return close
