"""Host-side async client of one sandbox's execution server.

One action at a time per sandbox (an ``asyncio.Lock``); a call that ends in any exception (a cancellation
included) drops its connection, so the next call reconnects; a dropped connection is re-opened and the running
request re-attached by id (the server keeps recent results), so a network hiccup does not lose or repeat a
command; a sandbox whose process is gone is reported as :class:`SandboxDeadError` at once, never waited on.

Code in the sandbox can stop the execution server and answer in its place, so every response is read as
hostile: a line longer than the request allows (:func:`sandbox.protocol.response_bytes`), one past
:data:`sandbox.protocol.MAX_RESPONSE_ITEMS` items, nested past :data:`sandbox.bounded_json.MAX_DEPTH`, not
JSON, or not of a response's shape (:func:`sandbox.protocol.check_response`) is a :class:`ProtocolError`,
raised before the host reads a field of it; the decode yields to the event loop while it scans a long line.
"""
from __future__ import annotations

import asyncio
import itertools
import select
import socket
import struct
import time
from typing import Any, Awaitable, Callable, Optional

from . import protocol
from .bounded_json import JsonBoundError, JsonBounds, aloads
from .errors import ERRORS_BY_NAME, ProtocolError, SandboxDeadError, SandboxError, ToolTimeout

RECONNECT_ATTEMPTS = 3
# Added to a call's own timeout before the client gives up on the server: the server needs time to interrupt
# the command (Ctrl-C grace + SIGKILL grace in bash_tool, interrupt grace in ipython_tool) and to answer.
SERVER_GRACE_S = 10.0
#: Seconds between connect attempts while a start waits for the execution server's readiness signal (a
#: fallback: the signal normally wakes the connect at once).
READY_FALLBACK_POLL_S = 0.01


class ExecClient:
    """Talks to ``socket_path``. ``died`` is an awaitable that completes when the sandbox's process exits
    (its result, e.g. the exit code, goes into the error message); ``describe`` names the sandbox in errors.
    ``peer_ok(pid) -> bool``: whether the process at the other end of a new connection (host pid, from
    ``SO_PEERCRED``) belongs to the sandbox. The socket's path is in the sandbox-writable run directory, so code
    in the sandbox can replace it with a link to another socket of the host: a connection whose peer fails the
    check is closed and refused (:class:`ProtocolError`). ``peer_pid``: the peer of the current connection.
    ``ready``: set once the server listens or the sandbox is gone (see ``sandbox.runtime._ReadyPipe``); until
    then a connect is tried every :data:`READY_FALLBACK_POLL_S` instead of every millisecond."""

    def __init__(self, socket_path: str, died: Callable[[], Awaitable[Any]], describe: str,
                 peer_ok: Optional[Callable[[int], bool]] = None, ready: Optional[asyncio.Event] = None) -> None:
        self._path = socket_path
        self._ready = ready
        self._peer_ok = peer_ok
        self.peer_pid: Optional[int] = None
        self._died_factory = died
        self._died: Optional[asyncio.Future] = None
        self._describe = describe
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        #: Requests written to the server, ``result`` reattaches excepted and a request resent after the server
        #: answered ``unknown request`` counted once: what the server took from this client, which a same-uid
        #: co-tenant's requests exceed (its ``ping`` answers ``served``, see sandbox.exec_server).
        self.sent = 0

    def _died_future(self) -> asyncio.Future:
        if self._died is None:
            self._died = asyncio.ensure_future(self._died_factory())
        return self._died

    def _dead_error(self, during: str) -> SandboxDeadError:
        fut = self._died_future()
        code = fut.result() if fut.done() and not fut.cancelled() and fut.exception() is None else "?"
        return SandboxDeadError(f"sandbox {self._describe} died (exit status {code}) {during}")

    async def connect(self, timeout_s: float) -> None:
        """Connect, retrying while the server is still starting. Raises :class:`SandboxDeadError` if the
        process exits first, :class:`ToolTimeout` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        # A refused connect costs ~20 us: poll every millisecond rather than back off, since the start latency
        # of a sandbox is decided here.
        delay = 0.001
        died = self._died_future()
        while True:
            if died.done():
                raise self._dead_error("before its execution server accepted a connection")
            try:
                reader, writer = await asyncio.open_unix_connection(self._path, limit=protocol.MAX_LINE_BYTES)
                sock = writer.get_extra_info("socket")
                pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[0]
                if self._peer_ok is not None and not self._peer_ok(pid):
                    writer.close()
                    raise ProtocolError(f"sandbox {self._describe}: {self._path} is answered by host process "
                                        f"{pid}, which is not part of the sandbox: refused")
                self._reader, self._writer, self.peer_pid = reader, writer, pid
                return
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            if time.monotonic() > deadline:
                raise ToolTimeout(f"sandbox {self._describe}: execution server did not listen on {self._path} "
                                  f"within {timeout_s:g} s")
            if self._ready is not None and not self._ready.is_set():
                # Woken by the server's readiness signal (or its death); the slow poll is only a fallback for a
                # launcher that does not pass the signal's descriptor on.
                try:
                    await asyncio.wait_for(self._ready.wait(), min(READY_FALLBACK_POLL_S,
                                                                  max(0.0, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(delay)

    def connection_alive(self) -> bool:
        """Whether a connection to the server is open and the server has not closed its end (no hang-up, no
        end of file, nothing unasked for waiting in the socket), checked without a round trip: what a warm pool asks before it
        hands a sandbox out (a server that died closed its end). ``False`` without a connection."""
        w, r = self._writer, self._reader
        if w is None or r is None or w.is_closing() or r.at_eof():
            return False
        sock = w.get_extra_info("socket")
        if sock is None:
            return False
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | select.POLLPRI | select.POLLRDHUP)
        return not p.poll(0)

    async def close(self) -> None:
        w, self._writer, self._reader = self._writer, None, None
        if w is not None:
            w.close()
            try:
                await w.wait_closed()
            except (OSError, ConnectionError):
                pass
        if self._died is not None and not self._died.done():
            self._died.cancel()

    async def call(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its result (a dict). Raises the typed error the server reported,
        :class:`SandboxDeadError` if the sandbox dies meanwhile, :class:`ToolTimeout` if no answer comes within
        ``timeout_s`` (callers add the tool's own timeout and :data:`SERVER_GRACE_S`)."""
        async with self._lock:
            try:
                return await self._call_locked(op, args, timeout_s)
            except BaseException:
                # Any exception (cancellation included) may leave this stream mid-request: a read still pending
                # on it, or the late answer of the abandoned request arriving first. Drop it so that the next
                # call reconnects from a clean state (a reconnect costs well under a millisecond); the server
                # keeps running the abandoned request, independently of any connection.
                self._drop_connection()
                raise

    async def _call_locked(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        rid = next(self._ids)
        deadline = time.monotonic() + timeout_s
        request = protocol.encode({"id": rid, "op": op, "args": args})
        max_bytes = protocol.response_bytes(op, args)
        expect = {rid}
        for attempt in range(RECONNECT_ATTEMPTS + 1):
            try:
                if self._writer is None:
                    await self.connect(max(0.1, min(5.0, deadline - time.monotonic())))
                if len(expect) == 1:  # the request itself, not a "result" reattach after a reconnect
                    self.sent += 1
                self._writer.write(request)
                msg = await self._read_response(expect, deadline, op, max_bytes)
                if msg.get("id") != rid and (msg.get("error") or {}).get("type") == protocol.UNKNOWN_REQUEST:
                    # The server never got the request before the connection broke: send it again (counted once
                    # in `sent`, when it was first sent: one request the server will take once)
                    expect = {rid}
                    self._writer.write(protocol.encode({"id": rid, "op": op, "args": args}))
                    msg = await self._read_response(expect, deadline, op, max_bytes)
                break
            except (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError) as e:
                self._drop_connection()
                if self._died_future().done():
                    raise self._dead_error(f"while running {op}") from None
                # Give the process a moment to finish dying before deciding it was only the connection.
                try:
                    await asyncio.wait_for(asyncio.shield(self._died_future()), 0.05)
                    raise self._dead_error(f"while running {op}") from None
                except asyncio.TimeoutError:
                    pass
                if attempt == RECONNECT_ATTEMPTS:
                    raise SandboxDeadError(f"sandbox {self._describe}: connection lost {attempt + 1} times "
                                           f"during {op}: {e}") from None
                reattach_id = next(self._ids)
                expect.add(reattach_id)
                request = protocol.encode({"id": reattach_id, "op": "result", "args": {"id": rid}})
        if msg.get("ok"):
            return msg.get("result") or {}
        err = msg.get("error") or {}
        cls = ERRORS_BY_NAME.get(err.get("type"), SandboxError)
        raise cls(err.get("message") or "the execution server reported an error without a message")

    def _drop_connection(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def _read_response(self, expect: set[int], deadline: float, op: str, max_bytes: int) -> dict[str, Any]:
        """The next response line for one of the request ids ``expect`` (older ones skipped), read within
        ``max_bytes`` and decoded within bounds; raises :class:`ProtocolError` for one out of bounds or shape."""
        died = self._died_future()
        while True:
            read = asyncio.ensure_future(self._reader.readline())
            timeout = deadline - time.monotonic()
            try:
                done, _ = await asyncio.wait({read, died}, timeout=max(0.0, timeout),
                                             return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                # Cancelled while waiting: a readline left pending would make the next call's read on this
                # stream fail ("readuntil() called while another coroutine is already waiting").
                read.cancel()
                raise
            if read not in done:
                read.cancel()
                self._drop_connection()
                if died in done:
                    raise self._dead_error(f"while running {op}")
                raise ToolTimeout(f"sandbox {self._describe}: no answer to {op} within the timeout plus "
                                  f"{SERVER_GRACE_S:g} s grace; the sandbox is unresponsive")
            try:
                line = read.result()
            except ValueError:  # asyncio's LimitOverrunError, as readline() raises it: no newline in the limit
                raise ProtocolError(f"sandbox {self._describe}: a response line to {op} is longer than "
                                    f"{protocol.MAX_LINE_BYTES} bytes") from None
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            if len(line) > max_bytes:
                raise ProtocolError(f"sandbox {self._describe}: the response line to {op} is {len(line)} bytes, more "
                                    f"than the {max_bytes} it may be")
            try:
                msg = protocol.check_response(await aloads(line, JsonBounds(max_bytes, protocol.MAX_RESPONSE_ITEMS)))
            except ValueError as e:
                reason = f"it {e}" if isinstance(e, JsonBoundError) else str(e)
                raise ProtocolError(f"sandbox {self._describe}: invalid response to {op}: {reason}") from None
            if msg.get("id") in expect:
                return msg
            if msg.get("id") is None:
                err = msg.get("error") or {}
                raise ProtocolError(f"sandbox {self._describe}: {err.get('message', 'protocol error')}")
            # A response to an older, abandoned request (e.g. after a reconnect): skip it.
