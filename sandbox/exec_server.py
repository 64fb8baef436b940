"""The execution server that runs inside a sandbox: ``python -S -m sandbox.exec_server --socket PATH
--config PATH``.

It listens on a Unix domain socket in a directory bound from the host and serves the tools (``bash``,
``ipython``, ``editor``, ``upload``, ``download``) with the JSON-lines protocol of :mod:`sandbox.protocol`.
Each request runs independently of the connection it came on: if the connection drops, the host reconnects and
asks for the result with ``{"op": "result", "args": {"id": N}}``.

Config file (JSON): ``workspace`` (path inside the sandbox), ``run_dir`` (bound, writable; holds the socket,
the kernel's ipc files and the shell's command file), ``env`` (environment of shell and kernel), ``limits``
(:class:`sandbox.spec.Limits` as a dict), ``sessions_file`` (optional; where to record the shell's session for
a host without a pid namespace to reap), ``run_as`` (optional ``[uid, gid]`` to drop to before anything runs),
``ready_fd`` (optional: an inherited pipe's write end to write one byte to once the socket listens; the server
exits when that write finds no reader, and later when the host's read end closes: the host died or closed it).

``ping`` answers ``{pid, pidns, served}``; with ``{"warm": true}`` it also starts the persistent shell after
answering (otherwise the first ``bash`` request does). ``served``: the requests this server has taken, every
decoded one but ``result`` (a reattach), this ping included: the host compares it with what it sent itself, so a
same-uid co-tenant that used the socket before the model's first call is seen (issue #36, red team row 2).

SIGTERM or a ``shutdown`` request: the shell's session and the kernel are killed, then the server exits.
Imports are kept minimal (no asyncio, pydantic, json, re, enum, socket, signal, selectors, collections or functools;
and ``os``, ``binascii``, ``heapq`` and the bash tool's modules only on their first use; tests/sandbox/
test_start_path.py checks) because this module's start time is the sandbox's start time.
"""
from __future__ import annotations

# `posix`, not `os`, on the start path: `os` imports and runs _collections_abc, stat and posixpath (~1.1 ms at
# every start); the tools that need os.path (file transfers, the editor, the shell) import it when first used.
import posix
import sys
# The C modules behind `socket`, `signal` and `functools`: those import enum and collections and build enum
# classes of every constant (~7 ms at every sandbox start); the server needs a Unix socket, two handlers and
# `partial`.
import _signal
import _socket
from _functools import partial
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

from . import protocol
from .protocol import UNKNOWN_REQUEST
from .errors import FileTransferError, SandboxError
from .eventloop import EventLoop

RECENT_RESULTS = 16
DEFAULT_DOWNLOAD_MAX_BYTES = 32 * 1024 * 1024


class _Conn:
    def __init__(self, server: "ExecServer", sock: _socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.closed = False

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        start = len(self.rbuf)  # only new bytes can hold the next newline: large uploads stay linear
        self.rbuf += data
        while True:
            i = self.rbuf.find(b"\n", start)
            if i < 0:
                break
            line = bytes(self.rbuf[:i])
            del self.rbuf[:i + 1]
            start = 0
            self.server.dispatch(self, line)
            if self.closed:
                return
        if len(self.rbuf) > protocol.MAX_LINE_BYTES:
            self.send(protocol.encode({"id": None, "ok": False, "error": {
                "type": "ProtocolError", "message": "request line too long"}}))
            self.close()

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        self.wbuf += data
        self.flush()

    def flush(self) -> None:
        try:
            while self.wbuf:
                n = self.sock.send(self.wbuf)
                del self.wbuf[:n]
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            return
        if self.wbuf:
            self.server.loop.add_writer(self.fd, self.flush)
        else:
            self.server.loop.remove_writer(self.fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.loop.remove_reader(self.fd)
        self.server.loop.remove_writer(self.fd)
        self.sock.close()


class ExecServer:
    """One per sandbox. ``serve_forever()`` blocks until shutdown."""

    def __init__(self, socket_path: str, config: dict[str, Any]) -> None:
        self.loop = EventLoop()
        self.socket_path = socket_path
        self.workspace = config["workspace"]
        self.run_dir = config["run_dir"]
        env = dict(config.get("env") or {})
        limits = dict(config.get("limits") or {})
        self._tool_args = dict(workspace=self.workspace, env=env, run_dir=self.run_dir, limits=limits,
                               sessions_file=config.get("sessions_file"))
        self._bash = None
        self._ipython = None
        self._editor = None
        self._running: dict[Any, Optional[_Conn]] = {}
        self._recent: dict[Any, dict] = {}  # oldest first (dicts keep insertion order)
        self._listener: Optional[_socket.socket] = None
        self._warmed = False
        #: Decoded requests taken, ``result`` reattaches excepted (what ``ping`` reports as ``served``).
        self._served = 0
        ready_fd = config.get("ready_fd")
        self._ready_fd = ready_fd if isinstance(ready_fd, int) and ready_fd > 2 else None

    @property
    def editor(self):
        if self._editor is None:
            from .editor import Editor  # lazily, like the kernel: the server's start time is the sandbox's

            self._editor = Editor(self.workspace)
        return self._editor

    @property
    def bash(self):
        if self._bash is None:
            # lazily: its module and C modules cost ~1.5 ms at every start, and a sandbox used only for files
            # or IPython never needs it (the shell itself starts on the first bash request or a warm ping)
            from .bash_tool import BashSession

            self._bash = BashSession(self.loop, **self._tool_args)
        return self._bash

    @property
    def ipython(self):
        if self._ipython is None:
            from .ipython_tool import IPythonSession

            self._ipython = IPythonSession(self.loop, **self._tool_args)
        return self._ipython

    # ------------------------------------------------------------------------------------------- serving
    def serve_forever(self) -> None:
        try:
            posix.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        lst = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        lst.bind(self.socket_path)
        posix.chmod(self.socket_path, 0o600)
        lst.listen(16)
        lst.setblocking(False)
        self._listener = lst
        self.loop.add_reader(lst.fileno(), self._accept)
        if self._ready_fd is not None:
            # Tell the host it may connect now (it waits on this pipe instead of polling the socket). No reader
            # means the host died while this sandbox started, maybe before bwrap armed --die-with-parent (its
            # PR_SET_PDEATHSIG then names init): nobody will ever use or close this sandbox, so it ends itself.
            try:
                posix.write(self._ready_fd, b"1")
            except BrokenPipeError:
                self.shutdown_tools()
                return
            except OSError:
                pass
            else:
                # Kept for the sandbox's life, never inherited by a tool: the host holds the read end until it
                # closes the sandbox, so an error on this end (EPOLLERR: no reader left) means the host is gone,
                # whatever bwrap's parent-death signal saw.
                posix.set_inheritable(self._ready_fd, False)
                self.loop.add_reader(self._ready_fd, self._host_gone)
        try:
            self.loop.run_forever()
        finally:
            self.shutdown_tools()

    def _host_gone(self) -> None:
        """The host's end of the readiness pipe closed (the host closed the sandbox or died): stop serving."""
        self.loop.remove_reader(self._ready_fd)
        self.loop.stop()

    def _accept(self) -> None:
        try:
            fd, _ = self._listener._accept()  # accept4(SOCK_CLOEXEC): no tool inherits a connection
        except BlockingIOError:
            return
        sock = _socket.socket(fileno=fd)
        sock.setblocking(False)
        conn = _Conn(self, sock)
        self.loop.add_reader(conn.fd, conn.on_readable)

    def shutdown_tools(self) -> None:
        if self._bash is not None:
            self._bash.close()
        if self._ipython is not None:
            self._ipython.close()
        try:
            posix.unlink(self.socket_path)
        except OSError:
            pass

    # -------------------------------------------------------------------------------------------- requests
    def dispatch(self, conn: _Conn, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except ValueError as e:
            conn.send(protocol.encode({"id": None, "ok": False,
                                       "error": {"type": "ProtocolError", "message": f"bad request: {e}"}}))
            return
        rid, op, args = msg.get("id"), msg.get("op"), msg.get("args") or {}
        if op != "result":
            self._served += 1
        try:
            if op == "ping":
                self._reply(conn, rid, {"pid": posix.getpid(), "pidns": _pid_namespace(), "served": self._served})
                if args.get("warm") and not self._warmed:
                    self._warmed = True
                    # Start the shell now, after the answer, so that the first bash call finds it ready. Only
                    # when asked (a warm pool's sandbox, which waits anyway): its ~15 ms of CPU (ptyprocess's
                    # imports, bash's start) right after every start made 64 concurrent starts ~40% slower on 2
                    # cores; otherwise the first bash call starts it.
                    self.loop.call_later(0, self.bash.spawn)
            elif op == "bash":
                bash = self.bash
                from .bash_tool import DEFAULT_MAX_OUTPUT_BYTES  # loaded with the session just above

                self._running[rid] = conn
                bash.run(str(args["command"]), float(args.get("timeout_s", 30.0)),
                         int(args.get("max_output_bytes") or DEFAULT_MAX_OUTPUT_BYTES), partial(self._complete, rid))
            elif op == "ipython":
                self._running[rid] = conn
                self.ipython.run(str(args["code"]), float(args.get("timeout_s", 30.0)),
                                 partial(self._complete, rid))
            elif op == "editor":
                kw = dict(args)
                self._reply(conn, rid, self.editor.run(kw.pop("command"), kw.pop("path"), **kw))
            elif op == "upload":
                self._reply(conn, rid, self._upload(args))
            elif op == "download":
                self._reply(conn, rid, self._download(args))
            elif op == "result":
                self._reattach(conn, rid, args.get("id"))
            elif op == "shutdown":
                self._reply(conn, rid, {})
                self.loop.stop()
            else:
                raise SandboxError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response, never a hang
            self._running.pop(rid, None)
            conn.send(protocol.encode({"id": rid, "ok": False, "error": _error_dict(e)}))

    def _reply(self, conn: _Conn, rid: Any, result: dict[str, Any]) -> None:
        conn.send(protocol.encode({"id": rid, "ok": True, "result": result}))

    def _complete(self, rid: Any, result: Optional[dict[str, Any]], exc: Optional[BaseException]) -> None:
        msg = ({"id": rid, "ok": True, "result": result} if exc is None
               else {"id": rid, "ok": False, "error": _error_dict(exc)})
        self._recent[rid] = msg
        while len(self._recent) > RECENT_RESULTS:
            del self._recent[next(iter(self._recent))]
        conn = self._running.pop(rid, None)
        if conn is not None and not conn.closed:
            conn.send(protocol.encode(msg))

    def _reattach(self, conn: _Conn, rid: Any, target: Any) -> None:
        if target in self._recent:
            msg = dict(self._recent[target])
            conn.send(protocol.encode(msg))
        elif target in self._running:
            self._running[target] = conn
        else:
            # The request never arrived (the connection broke while it was being sent): the client resends it.
            conn.send(protocol.encode({"id": rid, "ok": False, "error": {
                "type": UNKNOWN_REQUEST, "message": f"no request {target!r} is running or recently finished"}}))

    # ------------------------------------------------------------------------------------------ file I/O
    def _path(self, path: str) -> str:
        import os

        return path if os.path.isabs(path) else os.path.join(self.workspace, path)

    def _upload(self, args: dict[str, Any]) -> dict[str, Any]:
        import binascii  # a shared object to load: on the first transfer, not at every start
        import os

        path = self._path(str(args["path"]))
        data = binascii.a2b_base64(args.get("data_b64", ""))
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            if args.get("mode") is not None:
                os.chmod(path, int(args["mode"]))
        except OSError as e:
            raise FileTransferError(f"upload to {path} failed: {e.strerror or e}") from None
        return {"path": path, "bytes": len(data)}

    def _download(self, args: dict[str, Any]) -> dict[str, Any]:
        import binascii

        path = self._path(str(args["path"]))
        limit = int(args.get("max_bytes") or DEFAULT_DOWNLOAD_MAX_BYTES)
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise FileTransferError(f"download of {path} failed: {e.strerror or e}") from None
        if len(data) > limit:
            raise FileTransferError(f"download of {path} refused: larger than max_bytes={limit}")
        return {"path": path, "data_b64": binascii.b2a_base64(data, newline=False).decode("ascii")}


def _error_dict(e: BaseException) -> dict[str, str]:
    if isinstance(e, SandboxError):
        return {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, (KeyError, TypeError, ValueError)):
        return {"type": "ToolError", "message": f"bad arguments: {type(e).__name__}: {e}"}
    return {"type": "SandboxError", "message": f"{type(e).__name__}: {e}"}


def _pid_namespace() -> Optional[int]:
    """Inode of this process's pid namespace (the same number the host sees), or None."""
    try:
        return int(posix.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return None


def _drop_privileges(uid: int, gid: int) -> None:
    posix.setgroups([])
    posix.setresgid(gid, gid, gid)
    posix.setresuid(uid, uid, uid)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point. ``argv``: ``--socket PATH --config PATH``."""
    argv = sys.argv[1:] if argv is None else argv
    opts = dict(zip(argv[::2], argv[1::2]))
    if "--socket" not in opts or "--config" not in opts:
        sys.stderr.write("usage: python -m sandbox.exec_server --socket PATH --config PATH\n")
        raise SystemExit(2)
    with open(opts["--config"], "rb") as f:
        config = protocol.loads(f.read())
    if config.get("run_as"):
        _drop_privileges(*config["run_as"])
    posix.chdir(config["workspace"])

    server = ExecServer(opts["--socket"], config)

    def on_term(signum, frame):
        # Stop the loop rather than raise here: an exception raised in the middle of, say, a pty spawn would
        # leave a half-made process object behind (whose finaliser sleeps).
        server.loop.stop()

    _signal.signal(_signal.SIGTERM, on_term)
    _signal.signal(_signal.SIGHUP, on_term)
    server.serve_forever()


if __name__ == "__main__":
    main()
