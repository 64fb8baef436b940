"""Runs INSIDE the sandbox: relays a loopback TCP port to the gateway's Unix socket, then runs the agent.

    python3 launcher.py GATEWAY_SOCKET SESSION_FILE -- COMMAND...

SESSION_FILE holds the session's path, ``/sessions/<id>.<key>``: the key is a capability, so it travels in a
file only the sandbox's user can read, never on a command line (``ps`` shows those to every local user).

The sandbox has no network way out (``network="none"``: a private namespace with only its own loopback), so
the agent reaches its session through a Unix socket bound into the sandbox. Agents speak HTTP over TCP
(``OPENAI_BASE_URL``), so this relays ``127.0.0.1:<free port>`` inside the sandbox's namespace to that
socket byte for byte, sets ``OPENAI_BASE_URL=http://127.0.0.1:<port>SESSION_PATH/v1``,
``OPENAI_API_KEY`` and ``PRORL_SESSION_URL`` (for ``POST $PRORL_SESSION_URL/complete``), and runs COMMAND.
It exits with COMMAND's status; like ``env(1)`` and ``timeout(1)``, with 125 when it failed itself (bad
arguments, no gateway socket, no port to listen on: a message starting ``prorl-launcher:`` goes to stderr),
126 when COMMAND cannot be executed and 127 when it is not found. Standard library only: it runs under
whatever ``python3`` the image has.
"""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _relay(conn: socket.socket, path: str) -> None:
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
    back.start()
    _pump(conn, up)
    back.join()
    conn.close()
    up.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(conn, path), daemon=True).start()


FAILED, CANNOT_EXECUTE, NOT_FOUND = 125, 126, 127


def _fail(message: str) -> int:
    print(f"prorl-launcher: {message}", file=sys.stderr, flush=True)
    return FAILED


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        return _fail("usage: launcher.py GATEWAY_SOCKET SESSION_FILE -- COMMAND...")
    path, session_file, command = argv[0], argv[1], argv[3:]
    if not os.path.exists(path):
        return _fail(f"no gateway socket at {path}")
    try:
        with open(session_file) as f:
            session_path = f.read().strip().rstrip("/")
    except OSError as e:
        return _fail(f"cannot read the session file {session_file}: {e}")
    if not session_path.startswith("/sessions/"):
        return _fail(f"the session file {session_file} does not hold a /sessions/<id>.<key> path")
    try:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
    except OSError as e:
        return _fail(f"cannot listen on a loopback port: {e}")
    port = listener.getsockname()[1]
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    session_url = f"http://127.0.0.1:{port}{session_path}"
    key = session_path.rsplit("/", 1)[-1].partition(".")[2]
    env = dict(os.environ, OPENAI_BASE_URL=f"{session_url}/v1", OPENAI_API_KEY=key, PRORL_SESSION_URL=session_url)
    try:
        return subprocess.call(command, env=env)
    except OSError as e:
        print(f"prorl-launcher: cannot run {command[0]!r}: {e}", file=sys.stderr, flush=True)
        return NOT_FOUND if e.errno == errno.ENOENT else CANNOT_EXECUTE if e.errno == errno.EACCES else FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
