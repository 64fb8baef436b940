"""The ``bash`` tool: one persistent interactive bash on a pseudo-terminal (ptyprocess), driven by the
execution server's event loop.

How a call works: the shell is sent one line, ``eval $'<command, every non-printable byte escaped>'``, or,
for commands too long for one terminal line, the command goes to a file in the run directory and the line is
``IFS= read -r -d '' __prorl_cmd < FILE; eval "$__prorl_cmd"``. ``read`` and ``eval`` are builtins, so a
builtin command costs no fork; cwd, variables and functions persist because ``eval`` runs in the shell
itself; any length and any number of lines work. The end of the command
and its status are recognised by the prompt, ``PS1 = "\\x1e<nonce>:$?\\x1f"``.

Timeout: Ctrl-C on the terminal (SIGINT to the foreground job, like a user would), then SIGKILL to the
foreground process group, then a fresh shell. Output beyond ``max_output_bytes`` is counted but not kept.
"""
from __future__ import annotations

import os
import termios
import time
# The C modules behind `signal` and `functools`: those import enum and collections (milliseconds at every
# sandbox start), and this module needs one constant and `partial` of them.
from _functools import partial
from _signal import SIGKILL
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

from .eventloop import EventLoop, Timer
from .limits import child_setup
from .sessions import record_session

INTERRUPT_GRACE_S = 2.0
KILL_GRACE_S = 2.0
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
_TAIL_KEEP = 64
# A terminal in canonical mode accepts lines of at most 4095 bytes; longer commands go through a file.
_MAX_TYPED_LINE = 4000



class BashSession:
    """Persistent shell. ``run`` is asynchronous: it returns at once and calls ``done(result, None)`` later
    on the loop, with ``result`` a dict of :class:`sandbox.spec.BashResult` fields. One command at a time
    (the host client serialises calls); a second concurrent ``run`` is refused with ``RuntimeError``."""

    def __init__(self, loop: EventLoop, *, workspace: str, env: dict[str, str], run_dir: str,
                 limits: dict[str, Optional[int]], sessions_file: Optional[str] = None) -> None:
        self._loop = loop
        self._workspace = workspace
        self._env = env
        self._cmd_file = os.path.join(run_dir, "bash-command")
        self._limits = limits
        self._sessions_file = sessions_file
        self._proc = None
        self._ready = False
        self._nonce = os.urandom(8).hex().encode()
        self._marker = None  # compiled on spawn: `re` is not imported on the server's start path
        self._pending: Optional[tuple] = None
        self._current: Optional[dict[str, Any]] = None
        self._timer: Optional[Timer] = None
        self._scan = bytearray()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------------------------------ lifecycle
    def spawn(self) -> None:
        """Start the shell (non-blocking: readiness is seen on the loop). Idempotent."""
        if self._proc is not None:
            return
        import ptyprocess  # lazily: keeps the execution server's start fast
        import re

        if self._marker is None:
            self._marker = re.compile(rb"\x1e" + self._nonce + rb":(\d+)\x1f")

        self._proc = ptyprocess.PtyProcess.spawn(
            ["/bin/bash", "--noediting", "--norc", "--noprofile", "-i"], cwd=self._workspace, env=self._env,
            echo=False, dimensions=(50, 200), preexec_fn=partial(child_setup, self._limits))
        fd = self._proc.fd
        attrs = termios.tcgetattr(fd)
        attrs[1] &= ~termios.ONLCR  # keep "\n" as "\n" in the output (no "\r\n")
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
        os.set_blocking(fd, False)
        self._ready = False
        self._scan = bytearray()
        self._loop.add_reader(fd, self._on_readable)
        nonce = self._nonce.decode()
        setup = (f"PS1=$'\\x1e'{nonce}:'$?'$'\\x1f'; PS2=''; PROMPT_COMMAND=''; unset HISTFILE; "
                 "set +o history; stty -onlcr -echo 2>/dev/null\n")
        os.write(fd, setup.encode())
        if self._sessions_file:
            record_session(self._sessions_file, "bash", self._proc.pid)

    def close(self) -> None:
        """Kill the shell's whole session (its commands and background jobs in it)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._loop.remove_reader(proc.fd)
        _kill_session(proc.pid)
        # The session is already SIGKILLed: skip ptyprocess's 0.1 s courtesy sleeps (also run from __del__).
        proc.delayafterclose = 0.0
        proc.delayafterterminate = 0.001
        try:
            proc.close(force=True)
        except Exception:  # noqa: BLE001 - the shell is gone either way
            pass

    # ------------------------------------------------------------------------------------------- commands
    def run(self, command: str, timeout_s: float, max_output_bytes: int,
            done: "Callable[[Optional[dict[str, Any]], Optional[BaseException]], None]") -> None:
        if self._current is not None or self._pending is not None:
            raise RuntimeError("a bash command is already running in this sandbox")
        self._pending = (command, float(timeout_s), int(max_output_bytes), done, time.monotonic())
        if self._proc is None:
            try:
                self.spawn()
            except BaseException:
                self._pending = None  # e.g. fork refused under max_processes: the next call may try again
                self._proc = None
                raise
        if self._ready:
            self._start_pending()
        else:
            self._timer = self._loop.call_later(timeout_s, self._on_start_timeout)

    def _on_start_timeout(self) -> None:
        if self._pending is None:
            return
        done, timeout_s = self._pending[3], self._pending[1]
        self._pending = None
        self._timer = None
        self.close()
        done(None, RuntimeError(f"the shell did not become ready within {timeout_s:g} s (the sandbox may be out of "
                                "processes or memory); a new shell is tried on the next command"))

    def _start_pending(self) -> None:
        command, timeout_s, max_out, done, t0 = self._pending
        self._pending = None
        if self._timer is not None:
            self._timer.cancel()
        raw = command.encode("utf-8", errors="surrogateescape")
        literal = _ansi_c_quote(raw)
        if len(literal) <= _MAX_TYPED_LINE:
            # One printable-ASCII line: no file round trip (writing the file costs ~0.2 ms here).
            line = b"eval " + literal + b"\n"
        else:
            with open(self._cmd_file, "wb") as f:
                f.write(raw)
            line = f"IFS= read -r -d '' __prorl_cmd < '{self._cmd_file}'; eval \"$__prorl_cmd\"\n".encode()
        self._current = {"done": done, "t0": t0, "max": max_out, "head": bytearray(), "total": 0,
                         "timed_out": False, "timeout_s": timeout_s, "phase": "running"}
        self._scan = bytearray()
        self._timer = self._loop.call_later(max(0.0, timeout_s - (time.monotonic() - t0)), self._on_timeout)
        try:
            os.write(self._proc.fd, line)
        except OSError as e:  # the terminal's input queue is full (a program left input unread) or it is gone
            self.close()
            self._finish(None, f"[the command could not be sent to the shell ({e.strerror}); the shell was "
                               "restarted]")

    def _on_readable(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            data = os.read(proc.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._on_shell_exit()
            return
        if not self._ready:
            self._scan += data
            if self._marker.search(self._scan):
                self._ready = True
                self._scan = bytearray()
                if self._pending is not None:
                    self._start_pending()
            elif len(self._scan) > 1 << 16:
                del self._scan[:-_TAIL_KEEP]
            return
        if self._current is None:
            return  # output of a background job between commands: nobody asked for it
        self._scan += data
        m = self._marker.search(self._scan)
        if m:
            self._emit(self._scan[:m.start()])
            status = int(m.group(1))
            self._scan = bytearray()
            self._finish(status)
        elif len(self._scan) > 2 * _TAIL_KEEP:
            self._emit(self._scan[:-_TAIL_KEEP])
            del self._scan[:-_TAIL_KEEP]

    def _emit(self, data: bytes) -> None:
        cur = self._current
        cur["total"] += len(data)
        room = cur["max"] - len(cur["head"])
        if room > 0:
            cur["head"] += data[:room]

    def _finish(self, exit_code: Optional[int], notice: str = "") -> None:
        cur, self._current = self._current, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if cur is None:
            return
        out = bytes(cur["head"]).decode("utf-8", errors="replace")
        truncated = cur["total"] > cur["max"]
        notes = []
        if truncated:
            notes.append(f"[output truncated: showing the first {cur['max']} of {cur['total']} bytes]")
        if cur["timed_out"]:
            notes.append(f"[command timed out after {cur['timeout_s']:g} s and was interrupted]")
        if notice:
            notes.append(notice)
        if notes:
            out = out + ("" if not out or out.endswith("\n") else "\n") + "\n".join(notes)
        cur["done"]({"output": out, "exit_code": exit_code, "timed_out": cur["timed_out"],
                     "truncated": truncated, "output_bytes": cur["total"],
                     "duration_s": time.monotonic() - cur["t0"]}, None)

    # ------------------------------------------------------------------------------------------- timeouts
    def _on_timeout(self) -> None:
        cur = self._current
        if cur is None or self._proc is None:
            return
        cur["timed_out"] = True
        cur["phase"] = "interrupting"
        try:
            os.write(self._proc.fd, b"\x03")  # Ctrl-C: the line discipline sends SIGINT to the foreground job
        except OSError:
            pass
        self._timer = self._loop.call_later(INTERRUPT_GRACE_S, self._on_interrupt_ignored)

    def _on_interrupt_ignored(self) -> None:
        if self._current is None or self._proc is None:
            return
        self._current["phase"] = "killing"
        try:
            fg = os.tcgetpgrp(self._proc.fd)
            if fg > 0 and fg != self._proc.pid:
                os.killpg(fg, SIGKILL)
        except OSError:
            pass
        self._timer = self._loop.call_later(KILL_GRACE_S, self._on_kill_ignored)

    def _on_kill_ignored(self) -> None:
        if self._current is None:
            return
        self.close()
        self._finish(None, "[the shell did not respond to the interrupt and was restarted; cwd and "
                           "environment were reset]")

    def _on_shell_exit(self) -> None:
        proc = self._proc
        status: Optional[int] = None
        if proc is not None:
            self._loop.remove_reader(proc.fd)
            for _ in range(100):
                if not proc.isalive():
                    break
                time.sleep(0.001)
            status = proc.exitstatus if proc.exitstatus is not None else (
                -proc.signalstatus if proc.signalstatus else None)
            self.close()
        self._ready = False
        if self._current is not None:
            self._emit(bytes(self._scan))
            self._scan = bytearray()
            self._finish(status, f"[the shell exited (status {status}); a new shell starts with the next "
                                 "command]")
        elif self._pending is not None:
            _c, _t, _m, done, _t0 = self._pending
            self._pending = None
            done(None, RuntimeError("the shell exited while starting; check the sandbox's limits"))


def _ansi_c_quote(raw: bytes) -> bytes:
    """``raw`` as a bash ``$'...'`` word made of printable ASCII only (every other byte as ``\\xHH``), so the
    terminal's line discipline sees no control character and the command is one line whatever it contains."""
    out = bytearray(b"$'")
    for b in raw:
        if b == 0x27 or b == 0x5C:
            out += b"\\" + bytes([b])
        elif 0x20 <= b < 0x7F:
            out.append(b)
        else:
            out += b"\\x%02x" % b
    out.append(0x27)
    return bytes(out)


def _kill_session(sid: int) -> None:
    """SIGKILL every process whose session id is ``sid`` (the shell leads its own session)."""
    try:
        os.killpg(sid, SIGKILL)
    except OSError:
        pass
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, SIGKILL)
        except OSError:
            pass
