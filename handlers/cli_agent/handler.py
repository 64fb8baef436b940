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
- eval: ``"code"``: the ``code`` task's hidden tests (:mod:`handlers.code.task`, the scorer the ``code``
  handler uses) on ``/workspace/solution.py`` in a fresh sandbox (the default, and the only default, for an
  instance that carries tests); ``"reward_info"``:
  ``reward_info["reward"]`` as posted with ``/complete``: **the agent program is trusted**, because
  ``PRORL_SESSION_URL`` is in the environment of every process in the sandbox, so anything the agent runs
  (commands the model writes included) can post its own reward. Use it only for an agent program that never
  runs model-written code, or that computes the reward itself outside the model's reach; ``"none"``: 0.0.

Failures that are not the model's doing end the job with ``critical_error`` and ``failure_kind`` (so
``filter: true``, :mod:`prorl_server.failures`); the rule is that the model can only act on the run through
its answers, so a run in which it answered no request cannot be its outcome:

- the sandbox died or stopped answering while the agent ran: ``sandbox`` before the model answered a request;
  after it, the model's doing (``model_crashed_sandbox`` / ``model_stalled_sandbox``, a scored 0.0 with the
  session's trajectories kept: :mod:`prorl_server.failures`);
- the agent made LLM requests and none was answered (backend down, no backend): ``llm_backend``;
- no LLM request was made and the agent exited non-zero or ran out of time: exit status 126/127 (the shell's
  "not executable" / "command not found") is ``agent_missing``; 125 (the launcher's own failure, the
  convention of ``env``/``timeout``) or a sandbox image with no ``python3`` for the launcher is
  ``harness``; any other status is ``harness`` too (the agent crashed before it asked anything).

A present agent that asked the model and then exited non-zero (127 included) is a normal outcome, scored.

Why a Unix socket and not ``network="loopback"``: a loopback sandbox shares the host's network namespace
(rootless runtimes cannot filter it), so the agent could reach the rollout server's management API, other
sessions and the internet. With ``none`` its only way out is one socket that answers for its own session.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import os
import shlex
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from handlers.code.task import SOLUTION, evaluate_solution, grading_limits, sandbox_spec
from prorl_server.plugin import (AgentHandler, InfrastructureError, InstanceValidationError, InvalidInstanceError,
                                 NotRegradableError)
from prorl_server.plugin import STANDARD_TERMS, compose_reward, generated_texts, process_terms_async
from sandbox import Bind, ToolError

GATEWAY_DIR = "/run/prorl-gateway"
SOCKET_NAME = "gateway.sock"
SESSION_FILE = "session"  # the session's path, capability included (/sessions/<id>.<key>); mode 0600
LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.py").read_text()
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_COMPLETE_GRACE_S = 5.0
EVAL_MODES = ("code", "reward_info", "none")
EvalMode = Literal["code", "reward_info", "none"]
CODE_FIELDS = ("prompt", "tests", "entry_point")
# Fields that say an instance carries tests (the code handler's, and those of other test-graded datasets):
# such an instance is graded by its tests unless it names its eval mode itself.
TEST_FIELDS = ("tests", "test", "entry_point", "test_list", "FAIL_TO_PASS", "PASS_TO_PASS")
#: What an agent program's Python may import by default (those installed): the OpenAI SDK agents are written
#: with, and the sandbox's default computation and test packages. (The ``anthropic`` SDK here shares the
#: ``opentelemetry`` namespace with packages a sandbox may not see: name it in the setting where it installs
#: apart.)
AGENT_PYTHON_PACKAGES = ("openai", "httpx", "numpy", "sympy", "pytest")
LAUNCHER_FAILED = 125  # the launcher's own failure (env(1)/timeout(1) convention); 126/127 are the shell's
NOT_FOUND_STATUSES = (126, 127)


def _eval_mode(instance: dict[str, Any], default: Optional[str]) -> str:
    """The eval mode: the instance's ``eval``; else ``"code"`` if it carries tests (never ``reward_info``,
    whatever the handler's default); else the handler's default; else ``"reward_info"``.

    Raises:
        InvalidInstanceError: an unknown mode, or tests given without what ``"code"`` needs.
    """
    mode = instance.get("eval")
    carried = [k for k in TEST_FIELDS if k in instance]
    if mode is None:
        mode = "code" if carried else (default or "reward_info")
    if mode not in EVAL_MODES:
        raise InvalidInstanceError(f"cli_agent: eval must be one of {EVAL_MODES}, got {mode!r}")
    if mode == "code":
        missing = [k for k in CODE_FIELDS if not isinstance(instance.get(k), str) or not instance[k].strip()]
        if missing:
            why = (f"it carries tests ({', '.join(carried)}), so it is graded by them (eval='code'), "
                   if carried and "eval" not in instance else "eval='code' ")
            raise InvalidInstanceError(f"cli_agent instance: {why}which needs non-empty strings "
                                       f"{', '.join(CODE_FIELDS)}; missing or empty: {', '.join(missing)}")
    return mode


class CliAgentInstance(BaseModel):
    """A ``cli_agent`` instance (see :class:`CliAgentHandler`); other keys are allowed. Validated at submit
    with the handler's settings (their default ``command`` and ``eval``) in the validation context."""

    model_config = ConfigDict(extra="allow")

    command: Optional[str] = Field(default=None, description="shell command run in /workspace (default: the "
                                   "handler's command setting)")
    files: dict[str, Any] = Field(default_factory=dict, description="workspace path -> text")
    env: dict[str, Any] = Field(default_factory=dict, description="environment variables of the agent")
    eval: Optional[EvalMode] = None
    # strict: a bool is no number of seconds
    agent_timeout_s: float = Field(default=DEFAULT_AGENT_TIMEOUT_S, gt=0, strict=True, allow_inf_nan=False)
    complete_grace_s: float = Field(default=DEFAULT_COMPLETE_GRACE_S, gt=0, strict=True, allow_inf_nan=False)
    prompt: Optional[str] = None
    tests: Optional[str] = None
    entry_point: Optional[str] = None
    eval_timeout_s: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _command_and_eval_mode(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        handler = (info.context or {}).get("handler")
        settings = handler.settings if isinstance(handler, CliAgentHandler) else CliAgentSettings()
        command = data.get("command") or settings.command
        if not isinstance(command, str) or not command.strip():
            raise InstanceValidationError("cli_agent instance needs a non-empty string 'command' (or a handler "
                                          "default)", "instance.command")
        if data.get("eval") is None or data.get("eval") in EVAL_MODES:
            _eval_mode(data, settings.eval)  # tests without what "code" needs: refused, never reward_info
        return data


class CliAgentSettings(BaseModel):
    """The ``cli_agent`` handler's settings (``handlers: {cli_agent: {...}}``)."""

    model_config = ConfigDict(extra="forbid")

    command: Optional[str] = Field(default=None, description="agent command of instances that give none")
    eval: Optional[EvalMode] = Field(default=None, description="eval mode of instances that carry no tests "
                                     "and name no mode (default reward_info)")
    sandbox_image: Optional[str] = Field(default=None, description="image of the agent's sandbox (it needs "
                                         "python3); default: the server's")
    python_packages: Optional[tuple[str, ...]] = Field(
        default=None, description="Python distributions the agent's sandbox may import (an image-less sandbox "
        "sees only these, their requirements and the execution server's; docs/reward-integrity.md, I2); "
        f"default: those of {', '.join(AGENT_PYTHON_PACKAGES)} that are installed")


@functools.lru_cache(maxsize=1)
def _installed_agent_packages() -> tuple[str, ...]:
    out = []
    for name in AGENT_PYTHON_PACKAGES:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(name)
    return tuple(out)


def _seconds(instance: dict[str, Any], key: str, default: float) -> float:
    value = instance.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInstanceError(f"cli_agent: {key} must be a positive number of seconds, got {value!r}")
    return float(value)


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


@dataclass(slots=True)
class CliAgentState:
    """What a ``cli_agent`` job carries from init to run to eval (``job.state``)."""

    sandbox: Any = None  # the agent's sandbox handle (opened in init, closed when run ends)
    gateway_dir: str = ""  # the 0700 host directory of the session's socket and capability file
    owner: Optional[tuple[int, int]] = None  # the sandbox's (uid, gid) when it runs as another user
    command: str = ""
    eval: str = "none"  # "code" | "reward_info" | "none"
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    complete_grace_s: float = DEFAULT_COMPLETE_GRACE_S
    solution: Optional[str] = None  # eval="code": the solution file the agent left
    reward_info: Optional[dict[str, Any]] = None  # eval="reward_info": what the agent posted to its session
    generated_texts: Optional[list[str]] = None  # each turn's text, decoded from the tokens the server generated


class CliAgentHandler(AgentHandler):
    """Instance: ``{"data_source": "cli_agent", "command": "<shell command run in /workspace>",
    "files"?: {path: text}, "env"?: {name: value}, "eval"?: "code" | "reward_info" | "none",
    "agent_timeout_s"?: 600, "complete_grace_s"?: 5}``, plus ``prompt``/``tests``/``entry_point`` (and
    ``eval_timeout_s``) for ``eval="code"``: the default for an instance that carries tests, which is graded
    by them unless it names another mode itself (tests without ``entry_point`` or ``prompt`` are refused,
    ``failure_kind="invalid_instance"``, never graded by ``reward_info``). ``eval="reward_info"`` trusts the
    agent program (see the module docstring). A malformed instance is refused at submit (HTTP 422).

    The task of ``eval="code"`` is the ``code`` handler's (:mod:`handlers.code.task`: its sandbox and scorer);
    the harness is this handler's: the agent program through the gateway.

    Settings (:class:`CliAgentSettings`, from ``handlers: {cli_agent: {...}}`` or the constructor's arguments):
        command: default agent command for instances that give none.
        eval: default eval mode for instances that carry no tests and name no mode.
        sandbox_image: image for the agent's sandbox (None: the server's default); it needs ``python3``.
    """

    name = "cli_agent"
    needs_sandbox = True
    aliases = ("cli-agent", "black_box")
    needs_llm = True
    instance_model = CliAgentInstance
    settings_model = CliAgentSettings
    state_model = CliAgentState
    reward_terms = STANDARD_TERMS  # tool-call parse errors, language mixing: weight 0 unless the request asks

    def __init__(self, command: Optional[str] = None, eval: Optional[str] = None,
                 sandbox_image: Optional[str] = None) -> None:
        self.settings = CliAgentSettings(command=command, eval=eval, sandbox_image=sandbox_image)

    async def init(self, job) -> None:
        inst = job.instance
        settings: CliAgentSettings = self.settings
        command = inst.get("command") or settings.command
        if not isinstance(command, str) or not command.strip():
            raise InvalidInstanceError("cli_agent instance needs a non-empty string 'command' (or a handler "
                                       "default)")
        mode = _eval_mode(inst, settings.eval)
        files = inst.get("files") or {}
        env = inst.get("env") or {}
        if not isinstance(files, dict) or not isinstance(env, dict):
            raise InvalidInstanceError("cli_agent: 'files' and 'env' must be objects")
        agent_timeout_s = _seconds(inst, "agent_timeout_s", DEFAULT_AGENT_TIMEOUT_S)
        complete_grace_s = _seconds(inst, "complete_grace_s", DEFAULT_COMPLETE_GRACE_S)

        # mkdtemp makes it 0700: no other local user can reach the socket or read the session file in it.
        gw_dir = await asyncio.to_thread(tempfile.mkdtemp, prefix="prorl-gw-")
        job.add_closer(lambda: asyncio.to_thread(shutil.rmtree, gw_dir, True), "run")
        Path(gw_dir, "launcher.py").write_text(LAUNCHER_SOURCE)
        spec = sandbox_spec()
        spec.python_packages = (settings.python_packages if settings.python_packages is not None
                                else _installed_agent_packages())
        spec.binds = [*spec.binds, *_binds(gw_dir)]
        spec.env = {str(k): str(v) for k, v in env.items()}
        if settings.sandbox_image:
            spec.image = settings.sandbox_image
        handle = await job.open_sandbox(spec)
        owner = _sandbox_user(handle)
        if owner is not None:  # a root server's sandbox runs as an unprivileged uid of its own: it owns the dir
            await asyncio.to_thread(_chown_tree, gw_dir, owner)
        for path, text in files.items():
            try:
                await handle.upload(str(path), str(text).encode())
            except ToolError as e:  # e.g. a path outside the workspace: the instance's fault
                raise InvalidInstanceError(f"cli_agent: files[{str(path)!r}] cannot be written: {e}") from None
        if mode == "code":
            await handle.upload(SOLUTION, inst["prompt"].encode())
        job.state = CliAgentState(sandbox=handle, gateway_dir=gw_dir, owner=owner, command=command, eval=mode,
                                  agent_timeout_s=agent_timeout_s, complete_grace_s=complete_grace_s)

    async def run(self, job) -> None:
        state: CliAgentState = job.state
        handle = state.sandbox
        gw = job.services.gateway
        if gw is None:
            raise RuntimeError("this server has no gateway (job.services.gateway is None)")
        session = gw.create_session(job=job, metadata={"job_id": job.job_id, "instance_id": job.instance_id})
        job.add_closer(_abort_if_open(gw, session), "run")
        gw_dir, owner = state.gateway_dir, state.owner
        runner = await gw.serve_unix(session, os.path.join(gw_dir, SOCKET_NAME), owner=owner)
        job.add_closer(runner.cleanup, "run")
        # The capability travels in a file only the sandbox's user can read, never in a command line (every
        # local user sees those through ps).
        await asyncio.to_thread(_write_private, os.path.join(gw_dir, SESSION_FILE), f"/sessions/{session.ref}",
                                owner)
        argv = ["python3", f"{GATEWAY_DIR}/launcher.py", f"{GATEWAY_DIR}/{SOCKET_NAME}",
                f"{GATEWAY_DIR}/{SESSION_FILE}", "--", "bash", "-c", state.command]
        timeout_s = _within_budget(job, state.agent_timeout_s)
        agent = asyncio.ensure_future(handle.bash(" ".join(shlex.quote(a) for a in argv), timeout_s=timeout_s))
        completed = asyncio.ensure_future(session.completed.wait())
        try:
            await asyncio.wait({agent, completed}, return_when=asyncio.FIRST_COMPLETED)
            if not agent.done():  # completed by /complete: the process gets a grace period to exit
                await asyncio.wait({agent}, timeout=state.complete_grace_s)
        except BaseException:  # cancelled or timed out: the sandbox closes, the tool call goes with it
            agent.cancel()
            _keep_what_the_model_did(job, session)
            raise
        finally:
            completed.cancel()
        info: dict[str, Any] = {"exit_code": None, "timed_out": False, "output_tail": None}
        if agent.done() and agent.exception() is not None and not session.completed.is_set():
            # the sandbox died or stopped answering: before the model answered anything failure_kind "sandbox"
            # (filtered), after it the model's doing (model_crashed_sandbox, scored on what it did)
            _keep_what_the_model_did(job, session)
            raise agent.exception()
        if agent.done() and agent.exception() is None:
            r = agent.result()
            info.update(exit_code=r.exit_code, timed_out=r.timed_out, output_tail=r.output[-4000:])
            end = "agent_timeout" if r.timed_out else "exit"
        elif agent.done():  # the sandbox failed after the agent posted /complete: the agent was done
            end = "complete"
        else:  # still running after /complete and the grace period: closing the sandbox ends it
            agent.cancel()
            with contextlib.suppress(BaseException):
                await agent
            end = "complete"
        if state.eval == "code":
            state.solution = await asyncio.to_thread(_read_workspace_file, handle.workspace, SOLUTION)
        result = gw.finalize(session, reason=end)
        job.trajectories = session.trajectories()
        job.turns = session.turn_records()
        job.messages = result["messages"]
        state.reward_info = session.reward_info
        if job.llm is not None and job.trajectories:
            # the language-mixing term reads the tokens the server generated, never the history the agent
            # program (which runs the model's commands in its sandbox) sent back; the session loaded this
            # tokenizer already, so this is a cache hit
            with contextlib.suppress(Exception):  # decoding (bounded per turn) runs off the event loop
                state.generated_texts = await asyncio.to_thread(generated_texts, job.trajectories,
                                                                await job.llm.tokenizer(await job.backend()))
        job.extra["gateway"] = {**session.summary(), **info}
        await _raise_if_not_the_models(handle, session, end, info)

    def restore_for_eval(self, job, result) -> None:
        """Refused: eval grades what the agent program left in its sandbox (``eval="code"``: the solution file)
        or what it reported to its gateway session (``eval="reward_info"``); the result records neither."""
        raise NotRegradableError("the cli_agent handler grades what the agent program left in its run sandbox or "
                                 "reported to its gateway session; the result does not record it, so it cannot "
                                 "be re-graded")

    async def eval(self, job) -> None:
        state: CliAgentState = job.state
        mode = state.eval
        if mode == "code":
            limits = grading_limits({"eval_timeout_s": job.instance.get("eval_timeout_s")})
            reward, info = await evaluate_solution(job.open_sandbox, job.instance, state.solution,
                                                   limits.timeout_s, limits.call_timeout_s)
            job.reward, job.resolved = reward, reward == 1.0
            job.extra["eval"] = info
        elif mode == "reward_info":
            info = state.reward_info or {}
            value = info.get("reward", 0.0)
            job.reward = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
            job.resolved = bool(info.get("resolved", job.reward >= 1.0))
            job.extra["eval"] = {"reward_info": info}
        # the outcome, plus the opted-in process terms (host-computed: turn records and generated tokens)
        compose_reward(job, job.reward, await process_terms_async(job, texts=state.generated_texts or []))


#: Seconds of the job's budget kept for the eval stage when the agent's time is clamped to it (besides the
#: grading's own limit for ``eval="code"``).
EVAL_RESERVE_S = 5.0


def _within_budget(job: Any, agent_timeout_s: float) -> float:
    """The agent's time limit clamped to the job's remaining budget, less what eval needs: an agent that
    stalls ends as its own ``agent_timeout`` (and is graded) instead of running into the job's deadline."""
    left = job.remaining_s()
    if left is None:
        return agent_timeout_s
    reserve = EVAL_RESERVE_S
    if job.state.eval == "code":
        reserve += grading_limits({"eval_timeout_s": job.instance.get("eval_timeout_s")}).timeout_s
    return max(1.0, min(agent_timeout_s, left - reserve))


def _keep_what_the_model_did(job: Any, session: Any) -> None:
    """Before a run that failed raises: the session's trajectories so far go into the job, so a failure the
    model caused is scored on what it did (and a filtered one shows it)."""
    try:
        job.trajectories = session.trajectories()
        job.turns = session.turn_records()
    except Exception:  # a session in a state that cannot be read: the failure itself matters more
        pass


async def _raise_if_not_the_models(handle: Any, session: Any, end: str, info: dict[str, Any]) -> None:
    """Raise :class:`InfrastructureError` when the run's outcome cannot be the model's (see the module
    docstring): the model answered no request, and either requests were made or the agent did not end
    normally. Nothing the sandbox wrote decides this but the exit status of a run the model had no part in.
    """
    answered = sum(t.num_turns for t in session.trajectories())
    requests = int(session.counters.get("requests", 0))
    if answered:
        return
    status, tail = info["exit_code"], (info["output_tail"] or "")[-500:]
    if requests:
        raise InfrastructureError("llm_backend", f"cli_agent: the agent made {requests} LLM request(s) and none "
                                  f"was answered (end {end}, exit status {status}): {tail}")
    if (end == "exit" and status == 0) or end == "complete":
        return  # the agent finished without asking the model anything: its own choice
    if end == "agent_timeout":
        raise InfrastructureError("harness", "cli_agent: the agent ran out of time before its first LLM "
                                  f"request: {tail}")
    if status in NOT_FOUND_STATUSES:
        probe = await handle.bash("command -v python3 >/dev/null 2>&1", timeout_s=30.0)
        if probe.exit_code != 0:
            raise InfrastructureError("harness", "cli_agent: the sandbox image has no python3 to run the "
                                      f"launcher (exit status {status}): {tail}")
        raise InfrastructureError("agent_missing", f"cli_agent: the agent command is not there or not "
                                  f"executable (exit status {status}): {tail}")
    if status == LAUNCHER_FAILED:
        raise InfrastructureError("harness", f"cli_agent: the launcher failed (exit status {status}): {tail}")
    raise InfrastructureError("harness", f"cli_agent: the agent exited with status {status} before its first "
                              f"LLM request: {tail}")


def _sandbox_user(handle: Any) -> Optional[tuple[int, int]]:
    """(uid, gid) the sandbox's processes run as when it is not the server's user, else None."""
    ctx = getattr(handle, "_ctx", None)  # sandbox.runtime.LaunchContext.run_as
    run_as = getattr(ctx, "run_as", None)
    return tuple(run_as) if run_as else None  # type: ignore[return-value]


def _chown_tree(path: str, owner: tuple[int, int]) -> None:
    os.chown(path, *owner)
    for name in os.listdir(path):
        os.chown(os.path.join(path, name), *owner)


def _write_private(path: str, text: str, owner: Optional[tuple[int, int]]) -> None:
    """Write ``text`` to a new file of mode 0600 (owned by ``owner`` if given)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _binds(gw_dir: str) -> list[Any]:
    return [Bind(host=gw_dir, container=GATEWAY_DIR, ro=True)]


def _abort_if_open(gw, session):
    async def close() -> None:
        if session.is_open:  # the run failed or was cancelled before finalize: free the session
            gw.abort(session, "run_ended")

    return close
