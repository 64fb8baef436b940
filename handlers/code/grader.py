"""Grader of the ``code`` handler, run INSIDE the grader's sandbox (which the solution never touches):

    python3 -E -s grader.py SOCKET TOKEN

Connects to the host's Unix socket SOCKET, proves it is the grader with TOKEN, receives the instance's
trusted ``prompt`` and ``tests``, executes both (HumanEval tests use helpers the prompt defines, e.g.
``poly`` in HumanEval/32), then runs the tests' ``check(candidate)`` (the HumanEval protocol) with a proxy for
``candidate`` whose calls travel over the socket to the host, which relays them to the solution's sandbox.
One JSON line each way (values encoded by :mod:`plain`)::

    -> {"hello": TOKEN}
    <- {"job": {"prompt": str, "tests": str, "entry_point": str}}
    -> {"ready": true}   (the tests loaded) | {"invalid_tests": str} | {"verdict": ...} (no check function)
    <- {"start": true} | {"abort": str}
    -> {"call": {"args": [<value>...], "kwargs": {"name": <value>}}}        (per candidate call)
    <- {"value": <value>} | {"raised": {"type": str, "message": str}} | {"fatal": str}
    -> {"verdict": {"passed": bool, "error": str|null, "failed_test": str|null}}
       | {"invalid_tests": str}  (the tests do not load, or pass an argument that is not plain data)

Every message this side sends fits what the host accepts (:data:`plain.MAX_MESSAGE_BYTES`,
:data:`plain.MAX_ITEMS`), checked here before it is sent: texts built from the candidate's data (an assertion
message quoting its value: HumanEval/77, 78, 95, 97, 117, 148) are cut to :data:`plain.MAX_TEXT_CHARS`, and a
call too large to send once the candidate has answered (the tests built its argument from the candidate's
values) fails the test run as the candidate's, like any other answer past a bound. A bound crossed by the
candidate's data is its failed test, never the grader's fault.

The proxy only ever hands the tests freshly decoded plain data, so nothing the solution controls runs here.
A ``fatal`` answer (the solution's process died, timed out, or answered garbage or a value that is not plain
data) raises an exception outside the ``Exception`` hierarchy, so tests that catch errors cannot swallow it,
and fails the verdict whatever the tests do afterwards.
"""
from __future__ import annotations

import builtins
import linecache
import socket
import sys
import traceback

if __package__:  # imported as handlers.code.* (the unit tests); in a sandbox it runs as a script beside plain.py
    from . import plain
else:
    import plain

TESTS_FILE = "<hidden tests>"
PROMPT_FILE = "<prompt>"
# Builtin exceptions a candidate's own exception may be re-raised as (tests may expect e.g. ValueError).
# StopIteration / StopAsyncIteration never: raised inside a test's map() or iterator they end it early, as if
# every remaining case had passed.
_NOT_RAISED_AS = ("StopIteration", "StopAsyncIteration")


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin ``Exception`` type (message: type and text)."""


class CandidateFault(BaseException):
    """The candidate's process failed (died, timed out, answered garbage or non-plain data): the test run
    fails, whatever the tests do with this exception."""


class InvalidTests(BaseException):
    """The tests passed the candidate an argument that is not plain data: they cannot be graded here."""


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall(plain.dumps_line(message, max_items=plain.MAX_ITEMS))

    def recv(self) -> dict:
        line = self.reader.readline(plain.MAX_MESSAGE_BYTES + 1)
        if not line.endswith(b"\n"):
            raise ConnectionError("the host closed the grading channel")
        return plain.loads_line(line)


def _rebuilt(raised: dict) -> Exception:
    name, message = raised["type"], raised["message"]
    cls = getattr(builtins, name, None)
    if (isinstance(cls, type) and issubclass(cls, Exception) and name not in _NOT_RAISED_AS):
        try:
            return cls(message)
        except Exception:  # a builtin whose constructor wants other arguments (UnicodeDecodeError)
            pass
    return CandidateError(f"{name}: {message}")


class Grading:
    """One test run: the proxy's state (whether a fault or a grader error happened)."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.fault: str | None = None
        self.invalid_tests: str | None = None
        self.answered = False  # the candidate has answered a call: the tests may hold its data from now on

    def candidate(self, *args, **kwargs):
        if self.fault is not None:
            raise CandidateFault(self.fault)
        try:
            call = {"args": [plain.encode(a) for a in args], "kwargs": {k: plain.encode(v) for k, v in kwargs.items()}}
        except plain.PlainDataError as e:
            self.invalid_tests = plain.text(f"they pass the candidate an argument that cannot be sent: {e}")
            raise InvalidTests(self.invalid_tests) from None
        try:  # the host relays it to the candidate a few bytes longer: room for that is kept
            line = plain.dumps_line({"call": call}, plain.MAX_MESSAGE_BYTES - plain.RELAY_OVERHEAD_BYTES,
                                    plain.MAX_ITEMS)
        except plain.PlainDataError as e:
            if not self.answered:  # nothing of the candidate's yet: the tests' own argument is too large
                self.invalid_tests = plain.text(f"they pass the candidate an argument too large to send: {e}")
                raise InvalidTests(self.invalid_tests) from None
            # Built from what the candidate answered (HumanEval tests pass its values back): its data crossed
            # the bound, so the run fails as it would for an answer too large to send.
            self.fault = plain.text(f"a call built from the candidate's answers is too large to send ({e})")
            raise CandidateFault(self.fault) from None
        self.chan.sock.sendall(line)
        reply = self.chan.recv()
        if "value" in reply:
            self.answered = True
            return plain.decode(reply["value"])
        if "raised" in reply:
            self.answered = True
            raise _rebuilt(reply["raised"])
        self.fault = plain.text(reply.get("fatal", "malformed reply from the host"))
        raise CandidateFault(self.fault)


def run_tests(chan: Channel, job: dict) -> dict:
    ns: dict = {"__name__": "__grader__"}
    for name, source in ((PROMPT_FILE, job["prompt"]), (TESTS_FILE, job["tests"])):
        # Registered so that tracebacks can quote the failing assertion although no file exists.
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        prompt_code = compile(job["prompt"], PROMPT_FILE, "exec")
    except SyntaxError:  # an inline prompt need not be complete code; HumanEval's always are
        prompt_code = None
    try:
        if prompt_code is not None:
            exec(prompt_code, ns)
        exec(compile(job["tests"], TESTS_FILE, "exec"), ns)
    except BaseException as e:
        return {"invalid_tests": plain.text(f"they failed to load: {type(e).__name__}: {plain.text(e)}")}
    check = ns.get("check")
    if not callable(check):
        return {"verdict": {"passed": False, "error": "the tests define no check(candidate)", "failed_test": None}}
    chan.send({"ready": True})
    start = chan.recv()
    if "start" not in start:
        return {"verdict": {"passed": False, "error": plain.text(start.get("abort")), "failed_test": None}}
    grading = Grading(chan)

    def candidate(*args, **kwargs):
        return grading.candidate(*args, **kwargs)

    candidate.__name__ = candidate.__qualname__ = job["entry_point"]
    # The tests see the function's own name as the candidate too, as in HumanEval's reference execution (prompt,
    # completion and tests in one program): HumanEval/33 compares candidate(x) with sort_third(x). The prompt's
    # other helpers stay the prompt's: the solution cannot redefine what the tests check with.
    ns[job["entry_point"]] = candidate
    error = failed = None
    try:
        check(candidate)
    except BaseException as e:  # an assertion, the candidate's exception, or a fault
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == TESTS_FILE]
        failed = plain.text(frames[-1].line) if frames and frames[-1].line is not None else None
        # cut here: an assertion's message may quote the candidate's value (megabytes of it), and an error past
        # the host's bound would turn this failed test into a grader fault
        error = plain.text(f"{type(e).__name__}: {plain.text(e)}".strip())
    if grading.invalid_tests is not None:
        return {"invalid_tests": grading.invalid_tests}
    if grading.fault is not None:  # also when the tests caught the fault and carried on
        return {"verdict": {"passed": False, "error": plain.text(f"candidate fault: {grading.fault}"),
                            "failed_test": failed}}
    return {"verdict": {"passed": error is None, "error": error, "failed_test": failed}}


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: grader.py SOCKET TOKEN", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    chan = Channel(sock)
    chan.send({"hello": sys.argv[2]})
    job = chan.recv()["job"]
    chan.send(run_tests(chan, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
