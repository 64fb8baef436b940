"""Candidate server of the ``code`` handler, run INSIDE the solution's sandbox (never beside the grader):

    python3 -E -s candidate.py SOCKET SOLUTION.py ENTRY_POINT

Connects to the host's Unix socket SOCKET first (before any solution code runs), then executes the solution
and answers calls of its function ``ENTRY_POINT`` over that socket, one JSON line each way
(:mod:`plain` encodes the values)::

    -> {"loaded": true} | {"loaded": false, "error": "SyntaxError: ..."}        (once, after loading)
    <- {"id": 1, "args": [<value>...], "kwargs": {"name": <value>}}
    -> {"id": 1, "value": <value>} | {"id": 1, "raised": {"type": "ValueError", "message": "..."}}
       | {"id": 1, "refused": "not plain data: ..."}

Everything in this process is under the solution's control once it is loaded, so nothing here is trusted:
the host parses what arrives strictly and the verdict is decided in another sandbox. This file only makes an
honest solution's answers arrive intact. What the solution prints goes to this process's stdout/stderr,
which the host never reads.
"""
from __future__ import annotations

import socket
import sys

if __package__:  # imported as handlers.code.* (the unit tests); in a sandbox it runs as a script beside plain.py
    from . import plain
else:
    import plain

#: Longest exception message sent (the host accepts no more: one constant for both sides).
MAX_MESSAGE_CHARS = plain.MAX_TEXT_CHARS


def _convert(value):
    """What an honest solution may return that is not plain data but stands for it: a numpy scalar (as the
    Python number it holds) and the standard library's dicts (``Counter``, ``defaultdict``, ``OrderedDict``,
    as a dict). The host decodes whatever arrives as plain data, so this only spares honest answers."""
    import collections

    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if type(value) in (collections.Counter, collections.defaultdict, collections.OrderedDict):
        return dict.copy(value)
    return value


def _describe(e: BaseException) -> dict:
    try:
        message = str(e)[:MAX_MESSAGE_CHARS]
    except BaseException:  # a __str__ that raises
        message = ""
    return {"type": type(e).__name__[:100], "message": message}


def serve(chan, solution_path: str, entry_point: str) -> None:
    def send(message: dict) -> None:
        # the host's bounds, checked here: a value past them is refused by this side, never sent and refused there
        chan.sendall(plain.dumps_line(message, max_items=plain.MAX_ITEMS))

    ns = {"__name__": "__solution__", "__file__": solution_path}
    try:
        with open(solution_path, encoding="utf-8") as f:
            exec(compile(f.read(), solution_path, "exec"), ns)
        fn = ns.get(entry_point)
        if not callable(fn):
            send({"loaded": False, "error": f"solution defines no function {entry_point!r}"})
            return
    except BaseException as e:  # the solution may raise anything, SystemExit included
        d = _describe(e)
        send({"loaded": False, "error": plain.text(f"solution failed to load: {d['type']}: {d['message']}")})
        return
    send({"loaded": True})
    reader = chan.makefile("rb")
    while True:
        line = reader.readline(plain.MAX_MESSAGE_BYTES + 1)
        if not line:
            return
        request = plain.loads_line(line)
        args = plain.decode(["t", request["args"]])
        kwargs = {k: plain.decode(v) for k, v in request["kwargs"].items()}
        answer: dict = {"id": request["id"]}
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: they only fail this call
            answer["raised"] = _describe(e)
        else:
            try:
                answer["value"] = plain.encode(result, _convert)
                send(answer)
                continue
            except BaseException as e:  # not plain data, too large, or a conversion that raised
                answer = {"id": request["id"], "refused": f"{type(e).__name__}: {e}"[:MAX_MESSAGE_CHARS]}
        send(answer)


def main() -> int:
    if len(sys.argv) != 4:
        print("usage: candidate.py SOCKET SOLUTION.py ENTRY_POINT", file=sys.stderr)
        return 2
    sock_path, solution_path, entry_point = sys.argv[1:]
    chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    chan.connect(sock_path)
    serve(chan, solution_path, entry_point)
    return 0


if __name__ == "__main__":
    sys.exit(main())
