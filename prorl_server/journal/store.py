"""The journal: a durable record, in one SQLite file, of every job's request, state changes and result, every
completion the server requested (exact token ids, logprobs, per-token weight versions) and every gateway
exchange. What a crash must not lose, and what replay, re-grading and export read.

Storage: the standard library's ``sqlite3`` in WAL mode with ``synchronous=NORMAL`` (a committed transaction
survives a crash of the process, SIGKILL included; only a power loss can lose the last ones), one writing
connection, owned by a **writer process** (``python -m prorl_server.journal.writer``, started by
:meth:`Journal.start`). Writers on the event loop never touch SQLite: :meth:`Journal.job_submitted` and friends
pickle a row and write it to the writer's pipe (a few µs); the writer takes everything the pipe holds, writes
it in one transaction, commits, and reports back which rows are committed. ``Journal.flush()`` waits until
what was queued before it is committed (a result is acknowledged to its client only after that, so a result a
client saw is never lost). Why a process and not a thread: a writer thread needs the GIL back after each
SQLite call, and while the event loop is busy it waits up to ``sys.getswitchinterval()`` (5 ms) each time:
with a producer that never yields the GIL, 5,000 completions/s, a writer thread's commit p50 was 228 ms
(one statement a row) and, batched, p99 64 ms-1.4 s, against 6-90 ms for the process
(``benchmarks/journal_crash.py --store-only``, this 2-core machine at load 2-5); the process has a GIL of its
own. The price: ~5-7 µs per row for the caller (pickle + pipe write) instead of ~1.5 µs, and a second
process. A server SIGKILLed with rows still in the pipe: the writer commits them and exits (end of file),
then the next server takes the lock.

Encoding: token ids are stored as little-endian int32 arrays and logprobs as float64 arrays (exact, nothing
truncated); a completion's prompt is stored as the length of the prefix it shares with the same owner's
previous completion (prompt + output) plus the new ids only, so a 50-turn rollout does not store its context
50 times (:func:`expand_prompts` rebuilds them). The caller's side finds that prefix when the prompt is the same
live list (or a copy of it) continued; otherwise it sends the whole prompt and the writer compares bytes (so a
context the chat template rewrote is stored whole).

Gateway exchanges are stored as the decoded request re-encoded compactly (no whitespace), its ``messages``
without those it shares with the same owner's previous request (``prefix_messages``; :meth:`Journal.gateway_exchanges`
rebuilds them), so what a session costs is bounded by what it added, not by how it was written: a client that
padded 2 MiB bodies with whitespace wrote 80 MB for 160 generated tokens. Each owner (a job, or a session without
a job) may journal ``max_owner_bytes`` of gateway requests and answers and completions (prompt tails and output);
past it the gateway refuses the session's next request (:meth:`Journal.gateway_full`).

Retention: ``max_age_s`` (rows of jobs and job-less gateway sessions that ended longer ago are deleted) and
``max_bytes`` (the oldest ended ones, jobs and sessions alike, deleted until the live data, pages in use, is
under it), applied by the writer every ``retention_every_s`` in steps of at most ``retention_step_s`` between
commits. Space is handed back to the file system with ``PRAGMA incremental_vacuum`` in small steps
(``auto_vacuum=INCREMENTAL``, set when a journal is created; an older journal is converted once when opened,
if small, else its freed pages are only reused), never with a full VACUUM, which rewrote the whole file while
every commit waited. A finished result that retention deletes leaves its job id in ``expired`` (a tombstone,
~50 bytes): a resubmission of that id is answered "expired" (HTTP 410), never run a second time.

Sources: SQLite's WAL documentation (https://sqlite.org/wal.html: readers do not block the writer; with
``synchronous=NORMAL`` a commit is durable against application crashes); rLLM's gateway trace store (SQLite,
WAL, one connection).
"""
from __future__ import annotations

import array
import collections
import json
import logging
import os
import pickle
import queue
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

#: ``PRAGMA user_version`` of the journals this code writes; another version is refused, never guessed at, but
#: version 2 (no ``sessions`` or ``expired`` table, gateway requests stored as sent) is upgraded in place.
SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    handler TEXT,
    request BLOB,            -- the ProcessRequest as JSON: what replay and re-grading run again
    state TEXT NOT NULL,     -- submitted, init, run, eval, done
    submitted REAL NOT NULL, -- unix seconds
    updated REAL NOT NULL,
    result BLOB,             -- the JobResult as JSON once done
    filtered INTEGER         -- 1 when that result says filter: true (a resubmission runs the job again)
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_updated ON jobs(updated);
CREATE INDEX IF NOT EXISTS jobs_submitted ON jobs(submitted);
CREATE TABLE IF NOT EXISTS completions (
    id INTEGER PRIMARY KEY,
    owner TEXT NOT NULL,     -- the job id, or the gateway session id of a session without a job
    seq INTEGER NOT NULL,    -- order within the owner
    backend TEXT,
    prefix_len INTEGER NOT NULL,  -- prompt tokens shared with the owner's previous completion (prompt+output)
    prompt_tail BLOB NOT NULL,    -- int32 little-endian: the prompt's ids after that prefix
    token_ids BLOB NOT NULL,      -- int32 little-endian
    logprobs BLOB NOT NULL,       -- float64 little-endian
    version_runs TEXT NOT NULL,   -- JSON [[version, n], ...]
    finish_reason TEXT,
    stop_reason TEXT,             -- JSON: the stop token id or string that ended it, null for EOS/length
    params TEXT,                  -- hash of the request's other parameters (max_tokens, sampling): replay key
    t REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS completions_owner ON completions(owner, seq);
CREATE TABLE IF NOT EXISTS gateway (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,   -- the owner: the session's job id, or the session id of a session without a job
    seq INTEGER NOT NULL,
    request_hash TEXT NOT NULL, -- SHA-256 of the body as sent
    request BLOB NOT NULL,      -- compact JSON (see prefix_messages); the body as sent in rows of schema 2
    response BLOB NOT NULL,
    t REAL NOT NULL,
    prefix_messages INTEGER     -- the request's messages are the owner's previous request's first
                                -- prefix_messages, then those stored; NULL: stored as sent (schema 2)
);
CREATE INDEX IF NOT EXISTS gateway_session ON gateway(session_id, seq);
CREATE TABLE IF NOT EXISTS sessions (  -- gateway sessions without a job (their rows go with them)
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,        -- the owner of their completions
    updated REAL NOT NULL,
    ended INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_ended ON sessions(ended, updated);
CREATE TABLE IF NOT EXISTS expired (  -- tombstones: finished results that retention deleted
    job_id TEXT PRIMARY KEY,
    t REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS expired_t ON expired(t);
"""

#: Journals created by older code (no ``auto_vacuum``) up to this size are converted with one VACUUM when a
#: server opens them (before its writer starts: ~1 s per 100 MB here); a larger one keeps its size and reuses
#: the pages retention frees (convert it offline: ``prorl-journal vacuum JOURNAL``).
CONVERT_MAX_BYTES = 256 << 20

_LITTLE = sys.byteorder == "little"


def _pack(typecode: str, xs: Sequence) -> bytes:
    a = array.array(typecode, xs)
    if not _LITTLE:  # pragma: no cover - every supported platform is little-endian
        a.byteswap()
    return a.tobytes()


def _unpack(typecode: str, b: bytes) -> list:
    a = array.array(typecode)
    a.frombytes(b)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tolist()


def pack_ints(ids: Sequence[int]) -> bytes:
    """int32 little-endian bytes of ``ids``. Raises OverflowError for an id outside int32."""
    return _pack("i", ids)


def unpack_ints(b: bytes) -> list[int]:
    return _unpack("i", b)


def pack_floats(xs: Sequence[float]) -> bytes:
    """float64 little-endian bytes of ``xs``."""
    return _pack("d", xs)


def unpack_floats(b: bytes) -> list[float]:
    return _unpack("d", b)


@dataclass
class CompletionRecord:
    """One journalled completion: ``prompt_ids`` (the whole context, rebuilt), ``token_ids``, ``logprobs``
    (same length), ``version_runs``."""

    owner: str
    seq: int
    backend: Optional[str]
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version_runs: list[list[Optional[int]]]
    finish_reason: Optional[str]
    t: float
    stop_reason: Any = None
    params: Optional[str] = None


class JournalError(RuntimeError):
    """The journal cannot be opened or written (the message says which file and why)."""

#: The files of a journal at PATH besides PATH itself: SQLite's WAL, its shared memory, its rollback journal,
#: and this module's lock.
SIDECARS = ("-wal", "-shm", "-journal", ".lock")


def secure_journal_files(path: str) -> None:
    """Make the journal at ``path`` safe to open in a directory other users may write (issue #33): the journal
    holds every instance, answer and result, so no other local user may read it, and nobody may redirect it.

    ``path`` and each of its sidecars (:data:`SIDECARS`) that exists must be a regular file of this uid, not a
    symbolic link (one planted in a shared directory made a server write its journal into a directory of the
    planter's choosing); those that are readable by group or other are made ``0600``. A missing ``path`` is
    created ``0600`` with ``O_EXCL | O_NOFOLLOW`` (SQLite gives the ``-wal``/``-shm``/``-journal`` files it
    creates later the database file's mode, so they are ``0600`` too, whatever the umask). Blocking.

    Raises:
        JournalError: a file is a symbolic link, not a regular file, or another user's (the path is named).
    """
    uid = os.geteuid()
    for p in (path, *(path + s for s in SIDECARS)):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise JournalError(f"cannot open the journal {path}: {e}") from e
        if stat.S_ISLNK(st.st_mode):
            raise JournalError(f"refusing the journal file {p}: it is a symbolic link (to {os.readlink(p)!r}), "
                               "and a journal must be a file of its own: another user who can write the directory "
                               "may have put it there to read or replace the journal; remove it, or choose "
                               "another journal path")
        if not stat.S_ISREG(st.st_mode):
            raise JournalError(f"refusing the journal file {p}: it is not a regular file (mode "
                               f"{stat.filemode(st.st_mode)}); remove it, or choose another journal path")
        if st.st_uid != uid:
            raise JournalError(f"refusing the journal file {p}: it belongs to uid {st.st_uid}, not to this user "
                               f"(uid {uid}), who could read or replace it; remove it, or choose another path")
        if st.st_mode & 0o077:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass  # checked above (an empty file is an empty SQLite database)


def connect(path: str, busy_timeout_s: float = 30.0) -> sqlite3.Connection:
    """A connection to the journal at ``path`` (WAL, ``synchronous=NORMAL``, autocommit: transactions are
    explicit)."""
    db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class Journal:
    """See the module docstring.

    Args:
        path: the SQLite file (its directory is created).
        max_age_s: delete finished jobs (and their completions) older than this; None keeps them.
        max_bytes: keep the file under this many bytes by deleting the oldest finished jobs; None: no cap.
        retention_every_s: how often the writer applies retention.
        max_queue: rows waiting for the writer beyond which new rows are dropped and ``failed`` says so (the
            writer has been failing for that long; a caller is never blocked).
        readonly: open an existing journal to read it only (no lock, no writer): a journal a server may be
            writing can be read so.
        writer: ``"process"`` (the default: a child process ``python -m prorl_server.journal.writer`` commits;
            rows go to it over a pipe) or ``"thread"`` (a thread of this process commits: every SQLite call
            it makes waits for the GIL, up to ``sys.getswitchinterval()`` each while the event loop is busy;
            kept as the benchmark's baseline).
        max_owner_bytes: bytes one owner (a job, or a gateway session without a job) may journal in gateway
            exchanges and completions before the gateway refuses its next request (:meth:`gateway_full`); None: no
            cap. Counted by this process (since it opened the journal), as stored: compact requests, prompt tails.
        prealloc_wal: before the first commit, the writer writes the ``-wal`` file's space (zeros, 97 MiB with
            4 KiB pages, fsynced: 60-90 ms here) so commits overwrite allocated blocks instead of appending,
            which waited for the checkpointer's fsync (5-15 ms); the file is removed at a clean close. On in
            ``prorl-server`` (``--journal-prealloc-wal``), off by default here (tests open many journals).

    Raises:
        JournalError: the file cannot be opened as a journal.
    """

    #: SQLite's busy timeout of the writer, seconds (how long a commit waits for a lock another connection
    #: holds before it fails and is retried)
    busy_timeout_s = 30.0

    def __init__(self, path: str, *, max_age_s: Optional[float] = None, max_bytes: Optional[int] = None,
                 retention_every_s: float = 60.0, max_queue: int = 1_000_000, readonly: bool = False,
                 writer: str = "process", prealloc_wal: bool = False,
                 max_owner_bytes: Optional[int] = 64 << 20) -> None:
        if writer not in ("process", "thread"):
            raise ValueError(f"writer must be 'process' or 'thread', not {writer!r}")
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self.writer = writer
        self.prealloc_wal = prealloc_wal
        self.max_owner_bytes = max_owner_bytes
        self._lock_file: Any = None
        if readonly:  # a reader (prorl-journal, a test) of a journal a server may be writing: no lock, no schema
            if not os.path.isfile(self.path):
                raise JournalError(f"no journal at {self.path}")
            self._init_state(max_age_s, max_bytes, retention_every_s, max_queue)
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            secure_journal_files(self.path)
        except OSError as e:
            raise JournalError(f"cannot open the journal {self.path}: {e}") from e
        self._lock_file = self._take_lock()
        try:
            db = self._connect()
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
            if tables and version not in (2, SCHEMA_VERSION):
                db.close()
                raise JournalError(f"the journal {self.path} has schema version {version}, this server writes "
                                   f"version {SCHEMA_VERSION}: move it aside or point journal at a new file")
            if not tables:  # takes effect only before the first table exists
                db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            _upgrade(db, version if tables else SCHEMA_VERSION)
            db.execute("UPDATE sessions SET ended = 1 WHERE ended = 0")  # the server that had them open is gone
            if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                if os.path.getsize(self.path) <= CONVERT_MAX_BYTES:
                    db.execute("PRAGMA auto_vacuum = INCREMENTAL")
                    db.execute("VACUUM")  # once, at open: the writer has not started, nothing waits for it
                else:
                    log.warning("journal %s was created without auto_vacuum: retention will reuse the pages it "
                                "frees but the file will not shrink (convert it once, server stopped: "
                                "prorl-journal vacuum %s)", self.path, self.path)
            db.close()
        except (sqlite3.Error, OSError, JournalError) as e:
            self._lock_file.close()
            if isinstance(e, JournalError):
                raise
            raise JournalError(f"cannot open the journal {self.path}: {e}") from e
        self._init_state(max_age_s, max_bytes, retention_every_s, max_queue)

    def _init_state(self, max_age_s: Optional[float], max_bytes: Optional[int], retention_every_s: float,
                    max_queue: int) -> None:
        self.max_age_s, self.max_bytes, self.retention_every_s = max_age_s, max_bytes, retention_every_s
        self.max_queue = max_queue
        #: why the journal cannot record any more (the writer process died, rows were dropped); None while it can
        self.failed: Optional[str] = None
        self._last_error: Optional[str] = None
        self._reader: Optional[sqlite3.Connection] = None
        self._reader_lock = threading.Lock()
        self.checkpoint_every_s = 1.0
        self.counters = {"rows": 0, "commits": 0, "write_errors": 0}
        #: seconds from a row being queued to its commit, the last 100,000 at least (benchmarks read it; the
        #: writer process reports them when a flush waits)
        self.latencies: list[float] = []
        # producer side: owner -> (the prompt list last recorded, its length then, its output), so that a
        # prompt continuing it is sent as its new tail only
        self._ctx: dict[str, tuple[Any, int, list[int]]] = {}
        #: owner -> bytes it journalled (gateway rows, completions' prompt tails and outputs) since this opened
        self._owner_bytes: dict[str, int] = {}
        #: owner -> the messages (decoded, as received) of its last journalled gateway request
        self._gw_prev: dict[str, list[Any]] = {}
        self._sent = 0  # rows handed to the writer (numbered 1, 2, ...)
        self._acked = 0  # rows the writer has committed (or dropped as unstorable), in order
        self._waiters: list[tuple[int, Any]] = []  # (row number, callback(ok)) waiting for _acked >= it
        self._lock = threading.Lock()  # _sent and the pipe's byte order, _waiters, _acked
        self._started = False
        self._closing = False
        self._closed = False
        self._gone = False  # the writer ended: waiters are answered False
        # writer="thread"
        self._q: "queue.Queue[Any]" = queue.Queue()  # rows queued before start() wait here
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[_Store] = None
        # writer="process"
        self._proc: Optional[subprocess.Popen] = None
        self._wfd = -1
        self._pending: "collections.deque[memoryview]" = collections.deque()  # bytes the pipe had no room for
        self._pending_rows = 0
        self._wake_sender = threading.Condition(self._lock)
        self._ack_thread: Optional[threading.Thread] = None
        self._sender: Optional[threading.Thread] = None
        self._hello = threading.Event()  # the writer process reported for the first time: it is writing

    def _take_lock(self) -> Any:
        """Hold ``<path>.lock`` exclusively (``flock``) for this Journal's life: two servers writing one journal
        would each take the other's running jobs for interrupted ones and give one job id two results. The
        writer process holds it too (inherited), so a server restarted after a crash waits (up to 10 s) for the
        writer of the dead one to commit what it was given and exit.

        Raises:
            JournalError: another process holds it (its pid is in the message).
        """
        import fcntl

        lock_path = self.path + ".lock"
        # no link followed, no FIFO waited on, private (see secure_journal_files)
        f = os.fdopen(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                              | os.O_CLOEXEC, 0o600), "a+")
        deadline = time.monotonic() + 10.0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "?"
                if holder.isdigit() and not _alive(int(holder)) and time.monotonic() < deadline:
                    time.sleep(0.02)  # its server died: its writer process is finishing
                    continue
                f.close()
                raise JournalError(f"the journal {self.path} is in use by another process (pid {holder}, lock "
                                   f"{lock_path}): give each server its own journal") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _connect(self) -> sqlite3.Connection:
        return connect(self.path, self.busy_timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the writer (idempotent): a child process (``writer="process"``; returns once it has opened the
        file, ~0.1-0.2 s) or a thread.

        Raises:
            JournalError: the journal was opened ``readonly``, or the writer process cannot be started or
                cannot open the file."""
        if self.readonly:
            raise JournalError(f"the journal {self.path} was opened read-only")
        if self._started:
            return
        if self._closed:
            raise JournalError(f"the journal {self.path} was closed")
        config = {"path": self.path, "max_age_s": self.max_age_s, "max_bytes": self.max_bytes,
                  "retention_every_s": self.retention_every_s, "busy_timeout_s": self.busy_timeout_s,
                  "checkpoint_every_s": self.checkpoint_every_s, "prealloc_wal": self.prealloc_wal}
        if self.writer == "thread":
            self._store = _Store(**config)
            self._thread = threading.Thread(target=self._thread_writer, name="prorl-journal", daemon=True)
            self._thread.start()
            self._started = True
            return
        import fcntl

        data_r, data_w = os.pipe()
        ack_r, ack_w = os.pipe()
        try:
            fcntl.fcntl(data_w, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MiB (the unprivileged maximum by default)
        except OSError:
            pass
        os.set_blocking(data_w, False)
        cmd = [sys.executable, "-m", "prorl_server.journal.writer", json.dumps(
            {**config, "data_fd": data_r, "ack_fd": ack_w, "lock_fd": self._lock_file.fileno()})]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding this copy of prorl_server
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(data_r, ack_w, self._lock_file.fileno()),
                                          stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            for fd in (data_r, data_w, ack_r, ack_w):
                os.close(fd)
            raise JournalError(f"cannot start the journal writer for {self.path}: {e}") from e
        os.close(data_r)
        os.close(ack_w)
        self._wfd = data_w
        self._ack_thread = threading.Thread(target=self._acks, args=(ack_r,), name="prorl-journal-acks",
                                            daemon=True)
        self._ack_thread.start()
        self._sender = threading.Thread(target=self._send_pending, name="prorl-journal-sender", daemon=True)
        self._sender.start()
        self._started = True
        # the first rows would otherwise wait for the interpreter to start (~0.1-0.2 s); and a writer that
        # cannot open the file is an error now, not a result refused later
        if not self._hello.wait(60.0) or self._gone:
            rc = self._proc.poll()
            self.close(5.0)
            raise JournalError(f"the journal writer for {self.path} did not start "
                               f"({'exit code ' + str(rc) if rc is not None else 'no answer in 60 s'}; its "
                               f"error is in this process's stderr)")

    @property
    def last_error(self) -> Optional[str]:
        """Why the last commit failed, while the writer is retrying it; None when writing works."""
        return self._last_error

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer (a writer still failing gives up after ``timeout_s``; a
        writer process that does not exit by then is killed)."""
        self._closed = True
        if self._started:
            self._started = False
            if self.writer == "thread":
                assert self._thread is not None and self._store is not None
                self._q.put(None)
                self._thread.join(timeout_s)
                self._store.stopping.set()  # a writer still retrying gives up now
                self._thread.join(timeout_s)
                self._thread = None
                self._store = None
            else:
                deadline = time.monotonic() + timeout_s
                with self._lock:
                    self._closing = True
                    self._wake_sender.notify_all()
                assert self._sender is not None and self._proc is not None and self._ack_thread is not None
                self._sender.join(max(0.0, deadline - time.monotonic()))  # it writes what is pending, then closes
                try:
                    self._proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("journal %s: the writer process did not exit within %g s: killed", self.path,
                              timeout_s)
                    self._proc.kill()
                    self._proc.wait()
                self._ack_thread.join(5.0)
                self._proc = self._sender = self._ack_thread = None
            self._release_waiters()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._lock_file is not None and not self._lock_file.closed:
            self._lock_file.close()  # releases the flock (the writer process, which shared it, has exited)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until every row queued before this call is committed (from a thread; on the event loop use
        :meth:`aflush`). Returns False on timeout or when the writer is gone."""
        target = self._sent
        if self._acked >= target:
            return True
        self._put(("flush", None, 0.0))  # the writer reports back after the commit that holds it
        done = threading.Event()
        ok: list[bool] = []

        def callback(committed: bool) -> None:
            ok.append(committed)
            done.set()

        if not self._wait_for(target, callback):
            return self._acked >= target
        return done.wait(timeout_s) and ok[0]

    async def aflush(self, timeout_s: float = 30.0) -> bool:
        """:meth:`flush` for the event loop: waits without blocking it."""
        import asyncio

        target = self._sent
        if self._acked >= target:
            return True
        self._put(("flush", None, 0.0))  # the writer reports back after the commit that holds it
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def callback(committed: bool) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(committed))

        if not self._wait_for(target, callback):
            return self._acked >= target
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return False

    def _wait_for(self, n: int, callback: Any) -> bool:
        """Call ``callback(True)`` once row ``n`` is committed (``False`` if the writer ends first). Returns
        False (and registers nothing) when that is already decided."""
        with self._lock:
            if self._acked >= n or self._gone or not self._started:
                return False
            self._waiters.append((n, callback))
            return True

    def _committed(self, n: int, stats: dict[str, Any], latencies: Sequence[float]) -> None:
        """The writer reports: rows up to ``n`` are committed; ``stats`` its counters and last error."""
        self._last_error = stats.get("last_error")
        for k, v in stats.items():  # rows, commits, write_errors, retention_* (what retention deleted)
            if k != "last_error":
                self.counters[k] = v
        if latencies:
            lat = self.latencies
            lat.extend(latencies)
            if len(lat) > 200_000:
                del lat[:-100_000]
        ready = []
        with self._lock:
            if n > self._acked:
                self._acked = n
                keep = []
                for w in self._waiters:
                    (ready if w[0] <= n else keep).append(w)
                self._waiters = keep
        for _, callback in ready:
            callback(True)

    def _release_waiters(self) -> None:
        with self._lock:
            self._gone = True
            waiters, self._waiters = self._waiters, []
        for n, callback in waiters:
            callback(self._acked >= n)

    # ------------------------------------------------------------------ writes (any thread; never block on IO)
    def _put(self, row: tuple) -> None:
        if self._closed or self.readonly:
            self.counters["dropped"] = self.counters.get("dropped", 0) + 1
            return
        if self.writer == "thread":
            with self._lock:
                self._sent += 1
                self._q.put_nowait(row)
            return
        data = pickle.dumps(row, 5)
        frame = len(data).to_bytes(4, "little") + data
        with self._lock:
            if self.failed is not None and self._pending_rows >= self.max_queue:
                self.counters["dropped"] = self.counters.get("dropped", 0) + 1
                return
            self._sent += 1
            if not self._pending and self._wfd >= 0:
                try:
                    k = os.write(self._wfd, frame)
                except BlockingIOError:
                    k = 0
                except OSError as e:  # the writer process is gone: nothing more can be recorded
                    self._sent -= 1
                    self.counters["dropped"] = self.counters.get("dropped", 0) + 1
                    self.failed = self.failed or f"the journal's writer process is gone ({e})"
                    return
                if k == len(frame):
                    return
                frame = frame[k:]
            self._pending.append(memoryview(frame))
            self._pending_rows += 1
            if self._pending_rows >= self.max_queue:
                self.failed = self.failed or (f"{self.max_queue} rows wait for a writer that cannot write "
                                              f"({self._last_error}): rows are being dropped")
            self._wake_sender.notify()

    def _send_pending(self) -> None:
        """Sender thread: writes the bytes the pipe had no room for when they were queued (a large result,
        a writer that fell behind) as room frees up; at close, closes the pipe (the writer's cue to finish)."""
        import select

        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._wake_sender.wait()
                if not self._pending:  # closing and nothing left
                    os.close(self._wfd)
                    self._wfd = -1
                    return
            select.select([], [self._wfd], [], 1.0)
            with self._lock:
                try:
                    while self._pending:
                        chunk = self._pending[0]
                        k = os.write(self._wfd, chunk)
                        if k < len(chunk):
                            self._pending[0] = chunk[k:]
                            break
                        self._pending.popleft()
                        self._pending_rows -= 1
                except BlockingIOError:
                    pass
                except OSError as e:
                    self.failed = self.failed or f"the journal's writer process is gone ({e})"
                    self._pending.clear()
                    self._pending_rows = 0

    def _acks(self, fd: int) -> None:
        """Ack thread: reads the writer process's reports (rows committed, counters, latencies) and wakes the
        flushes they complete; when the process ends, says so in ``failed`` unless the journal is closing."""
        buf = bytearray()
        try:
            while True:
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                buf += data
                while len(buf) >= 4:
                    size = int.from_bytes(buf[:4], "little")
                    if len(buf) < 4 + size:
                        break
                    n, stats, lat = pickle.loads(bytes(buf[4:4 + size]))
                    del buf[:4 + size]
                    self._committed(n, stats, array.array("d", lat))
                    self._hello.set()
        finally:
            os.close(fd)
            proc = self._proc
            if not self._closing:
                rc = proc.wait() if proc is not None else None
                self.failed = self.failed or f"the journal's writer process exited (exit code {rc})"
                log.error("journal %s: %s", self.path, self.failed)
            self._release_waiters()
            self._hello.set()

    def _thread_writer(self) -> None:
        assert self._store is not None
        store, q = self._store, self._q
        store.open()
        done = 0
        stop = False
        while not stop:
            batch = [q.get()]
            while len(batch) < 5000:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                batch = [x for x in batch if x is not None]
                stop = True
            if batch:
                lat = store.write(batch, lambda: self._committed(done, store.stats(), ()))
                if lat is None:  # closed while its commits kept failing
                    self.failed = f"closed while its writes failed ({store.last_error})"
                    break
                done += len(batch)
                self._committed(done, store.stats(), lat)
                store.after_commit()
        store.close()

    def job_submitted(self, job_id: str, handler: str, request_json: bytes) -> None:
        """Record that ``job_id`` (of ``handler``; its request as JSON bytes) was submitted. O(1) for the
        caller here (a few µs: the row is pickled and written to the writer's pipe)."""
        now = time.time()
        self._put(("job", (job_id, handler, request_json, "submitted", now, now), time.perf_counter()))

    def job_state(self, job_id: str, state: str) -> None:
        self._put(("state", (state, time.time(), job_id), time.perf_counter()))

    def job_result(self, job_id: str, result_json: bytes, filtered: bool = False) -> None:
        self._put(("result", (result_json, int(bool(filtered)), time.time(), job_id), time.perf_counter()))

    def completion(self, owner: str, backend: Optional[str], prompt_ids: Sequence[int], token_ids: Sequence[int],
                   logprobs: Sequence[float], version_runs: Sequence[Sequence[Optional[int]]],
                   finish_reason: Optional[str], stop_reason: Any = None, params: Optional[str] = None) -> None:
        """Record one completion of ``owner`` (a job id or a gateway session id), in the order they were
        generated. ``prompt_ids`` may be a live context list that is only ever appended to (a conversation's
        ``token_ids``): its first ``len(prompt_ids)`` items at this call are what is recorded.

        Cost to the caller: when ``prompt_ids`` continues the owner's previous prompt + output (the same live
        list: O(output) to check; a copy of it: O(prompt) list compare, ~9 µs for 2,000 tokens) only the new
        tail is sent; otherwise (a context the chat template rewrote, the first turn) the whole prompt is sent
        and the writer compares it as bytes."""
        n = len(prompt_ids)
        start = 0
        last = self._ctx.get(owner)
        if last is not None:
            prev, prev_n, prev_out = last
            end = prev_n + len(prev_out)
            if n >= end and (prev is prompt_ids or prompt_ids[:prev_n] == prev[:prev_n]) \
                    and prompt_ids[prev_n:end] == prev_out:
                start = end
        out = list(token_ids)
        self._count(owner, 4 * (n - start) + 12 * len(out))  # int32 ids; an int32 id and a float64 logprob
        self._ctx[owner] = (prompt_ids, n, out)
        if len(self._ctx) > 4096:  # owners that never said they ended (it holds their last prompt list)
            self._ctx.pop(next(iter(self._ctx)))
        self._put(("completion", (owner, backend, start, list(prompt_ids[start:n]), out, list(logprobs),
                                  version_runs, finish_reason, stop_reason, params, time.time()),
                   time.perf_counter()))

    def reset_owner(self, owner: str) -> None:
        """A new attempt of ``owner`` starts (a resubmitted interrupted job): its journalled completions are
        deleted (read them first: they are what the new attempt replays) and it numbers its turns from 0."""
        self._ctx.pop(owner, None)
        self._owner_bytes.pop(owner, None)
        self._gw_prev.pop(owner, None)
        self._put(("reset", owner, 0.0))

    def forget_owner(self, owner: str) -> None:
        """The owner ended: no further completion of it will come (its previous context is dropped)."""
        self._ctx.pop(owner, None)
        self._owner_bytes.pop(owner, None)
        self._gw_prev.pop(owner, None)
        self._put(("forget", owner, 0.0))

    def _count(self, owner: str, n: int) -> None:
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + n
        if len(self._owner_bytes) > 100_000:  # owners that never said they ended
            self._owner_bytes.pop(next(iter(self._owner_bytes)))

    def gateway_full(self, *owners: str) -> Optional[str]:
        """Why ``owners`` (a gateway session's row owner and its completions' owner) may journal no more (they
        reached ``max_owner_bytes`` together), or None. At most one request past the cap is journalled: the
        one that crossed it (up to the gateway's 2 MiB body limit, compact)."""
        if self.max_owner_bytes is None:
            return None
        used = sum(self._owner_bytes.get(o, 0) for o in set(owners))
        if used < self.max_owner_bytes:
            return None
        return (f"it has journalled {used} bytes of requests, answers and tokens, the cap per job and per session "
                f"is {self.max_owner_bytes} (Journal max_owner_bytes)")

    def gateway_session(self, session_id: str, completions_owner: str) -> None:
        """A gateway session without a job is in use (its rows are its own: retention deletes them, oldest
        ended first, with its completions, owned by ``completions_owner``)."""
        self._put(("session", (session_id, completions_owner, time.time()), time.perf_counter()))

    def gateway_session_ended(self, session_id: str) -> None:
        """The job-less gateway session ``session_id`` ended: its rows may go once they are the oldest."""
        self._owner_bytes.pop(session_id, None)
        self._gw_prev.pop(session_id, None)
        self._put(("session_end", (time.time(), session_id), time.perf_counter()))

    def gateway_exchange(self, owner: str, seq: int, request_hash: str, request: Any, response: bytes) -> int:
        """Record one gateway exchange of ``owner`` (the session's job id, or its session id): ``request`` is
        the decoded body (not mutated afterwards: its messages are kept to compare the next request with),
        stored compact with its ``messages`` after those it shares with the owner's previous request;
        ``request_hash`` the SHA-256 of the body as sent; ``response`` the answer's bytes. O(new messages)
        to encode, O(messages) to compare (C-speed ``==``). Returns the bytes stored."""
        msgs = request.get("messages") if isinstance(request, dict) else None
        prefix = 0
        if isinstance(msgs, list):
            prev = self._gw_prev.get(owner)
            if prev:
                limit = min(len(prev), len(msgs))
                while prefix < limit and prev[prefix] == msgs[prefix]:
                    prefix += 1
                if prefix:
                    request = {**request, "messages": msgs[prefix:]}
            self._gw_prev[owner] = msgs
            if len(self._gw_prev) > 4096:  # owners that never said they ended (it holds their messages)
                self._gw_prev.pop(next(iter(self._gw_prev)))
        data = _compact(request)
        self._count(owner, len(data) + len(response))
        self._put(("gateway", (owner, seq, request_hash, data, response, time.time(), prefix),
                   time.perf_counter()))
        return len(data) + len(response)

    def size_bytes(self) -> int:
        """The journal's size on disk (the database and its WAL)."""
        return size_bytes(self.path)

    # ------------------------------------------------------------------ reads (any thread; a connection of their own)
    def _read(self) -> sqlite3.Connection:
        if self._reader is None:
            self._reader = self._connect()
        return self._reader

    def result(self, job_id: str) -> Optional[bytes]:
        """The finished result of ``job_id`` (JobResult JSON), or None (unknown or not finished)."""
        with self._reader_lock:
            row = self._read().execute("SELECT result FROM jobs WHERE job_id = ? AND state = 'done'",
                                       (job_id,)).fetchone()
        return row[0] if row else None

    def job(self, job_id: str) -> Optional[tuple[str, Optional[bytes], Optional[bytes], bool]]:
        """``(state, request JSON, result JSON or None, filtered)`` of ``job_id``, or None if it was never
        journalled."""
        with self._reader_lock:
            row = self._read().execute("SELECT state, request, result, filtered FROM jobs WHERE job_id = ?",
                                       (job_id,)).fetchone()
        return (row[0], row[1], row[2], bool(row[3])) if row else None

    def unfinished(self) -> list[str]:
        """Jobs journalled as submitted or running and never finished (what a crash interrupted)."""
        with self._reader_lock:
            return [r[0] for r in self._read().execute("SELECT job_id FROM jobs WHERE state != 'done'")]

    def iter_jobs(self, state: Optional[str] = "done") -> Iterator[tuple[str, Optional[str], bytes, Optional[bytes]]]:
        """``(job_id, handler, request JSON, result JSON)`` of every journalled job (of ``state``), oldest
        first."""
        db = self._connect()  # a connection of its own: iteration may be long
        try:
            q = "SELECT job_id, handler, request, result FROM jobs"
            cur = db.execute(q + " WHERE state = ? ORDER BY submitted", (state,)) if state else \
                db.execute(q + " ORDER BY submitted")
            yield from cur
        finally:
            db.close()

    def count_jobs(self, state: Optional[str] = "done") -> int:
        with self._reader_lock:
            q = "SELECT COUNT(*) FROM jobs" + (" WHERE state = ?" if state else "")
            return self._read().execute(q, (state,) if state else ()).fetchone()[0]

    def completions(self, owner: str) -> list[CompletionRecord]:
        """The completions of ``owner`` in order, prompts rebuilt (see :func:`expand_prompts`)."""
        with self._reader_lock:
            rows = self._read().execute(
                "SELECT owner, seq, backend, prefix_len, prompt_tail, token_ids, logprobs, version_runs, "
                "finish_reason, t, stop_reason, params FROM completions WHERE owner = ? ORDER BY seq",
                (owner,)).fetchall()
        return expand_prompts(rows)

    def gateway_exchanges(self, owner: str) -> list[tuple[int, str, bytes, bytes]]:
        """``(seq, request_hash, request, response)`` of a gateway owner (a job id, or the id of a session
        without a job), in the order they were recorded. ``request`` is the body as compact JSON with its
        whole ``messages`` (rebuilt from the previous request's), or, in a row of schema 2, as sent."""
        with self._reader_lock:
            try:
                rows = self._read().execute("SELECT seq, request_hash, request, response, prefix_messages FROM "
                                            "gateway WHERE session_id = ? ORDER BY id", (owner,)).fetchall()
            except sqlite3.OperationalError:  # a schema-2 journal read as it is: every request as sent
                rows = self._read().execute("SELECT seq, request_hash, request, response, NULL FROM gateway "
                                            "WHERE session_id = ? ORDER BY id", (owner,)).fetchall()
        out = []
        prev: list[Any] = []
        for seq, h, request, response, prefix in rows:
            if prefix is not None:
                body = json.loads(request)
                msgs = body.get("messages") if isinstance(body, dict) else None
                if isinstance(msgs, list):
                    body["messages"] = prev[:prefix] + msgs
                    prev = body["messages"]
                    request = _compact(body)
            out.append((seq, h, request, response))
        return out

    def expired(self, job_id: str) -> bool:
        """True when retention deleted ``job_id``'s finished (unfiltered) result: the id is spent."""
        with self._reader_lock:
            return self._read().execute("SELECT 1 FROM expired WHERE job_id = ?", (job_id,)).fetchone() is not None


def expand_prompts(rows: Sequence[tuple]) -> list[CompletionRecord]:
    """Journal rows of one owner (in ``seq`` order) as :class:`CompletionRecord` with whole prompts: each
    prompt is the first ``prefix_len`` ids of the previous completion's prompt + output, then its tail."""
    out: list[CompletionRecord] = []
    prev: list[int] = []
    for owner, seq, backend, prefix_len, tail, ids, lps, runs, finish, t, *rest in rows:
        prompt = prev[:prefix_len] + unpack_ints(tail)
        tokens = unpack_ints(ids)
        stop = json.loads(rest[0]) if rest and rest[0] is not None else None
        out.append(CompletionRecord(owner, seq, backend, prompt, tokens, unpack_floats(lps), json.loads(runs),
                                    finish, t, stop, rest[1] if len(rest) > 1 else None))
        prev = prompt + tokens
    return out


def size_bytes(path: str) -> int:
    """The size on disk of the journal at ``path`` (the database and its WAL)."""
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.path.getsize(path + suffix)
        except OSError:
            pass
    return total


def _runs_json(runs: Sequence[Sequence[Optional[int]]]) -> str:
    """``json.dumps(runs, separators=(",", ":"))`` for ``[[version or None, n], ...]`` in ~1 µs instead of ~12
    (it was the writer's largest cost per row after SQLite); anything else goes through ``json.dumps``."""
    try:
        parts = []
        for v, n in runs:
            if (v is not None and type(v) is not int) or type(n) is not int:
                raise TypeError
            parts.append(f"[{'null' if v is None else v},{n}]")
        return "[" + ",".join(parts) + "]"
    except (TypeError, ValueError):
        return json.dumps(runs, separators=(",", ":"))


def _upgrade(db: sqlite3.Connection, version: int) -> None:
    """Create the tables, upgrading a schema-2 journal in place: its gateway rows keep their requests as sent
    (``prefix_messages`` NULL) and its job-less sessions (gateway rows of an owner that is no job) are recorded
    as ended, so retention covers them."""
    script = SCHEMA
    if version == 2:
        script = ("ALTER TABLE gateway ADD COLUMN prefix_messages INTEGER;" + SCHEMA +
                  "INSERT OR IGNORE INTO sessions(session_id, owner, updated, ended) "
                  "SELECT session_id, 'gateway:' || session_id, MAX(t), 1 FROM gateway "
                  "WHERE session_id NOT IN (SELECT job_id FROM jobs) GROUP BY session_id;")
    db.executescript(f"BEGIN;{script}PRAGMA user_version = {SCHEMA_VERSION};COMMIT;")


def _compact(value: Any) -> bytes:
    """``value`` (decoded JSON) as compact JSON bytes: no whitespace, non-ASCII as UTF-8."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Store:
    """The writer's side: one connection that commits batches of rows (in the writer process, or the writer
    thread), retention, and a checkpointer thread. Not thread-safe: one caller of :meth:`write`."""

    _SQL = {
        "job": "INSERT OR REPLACE INTO jobs(job_id, handler, request, state, submitted, updated) "
               "VALUES (?, ?, ?, ?, ?, ?)",
        "state": "UPDATE jobs SET state = ?, updated = ? WHERE job_id = ? AND state != 'done'",
        "result": "UPDATE jobs SET state = 'done', result = ?, filtered = ?, updated = ? WHERE job_id = ?",
        "completion": "INSERT INTO completions(owner, seq, backend, prefix_len, prompt_tail, token_ids, logprobs, "
                      "version_runs, finish_reason, stop_reason, params, t) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        "gateway": "INSERT INTO gateway(session_id, seq, request_hash, request, response, t, prefix_messages) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
        "session": "INSERT INTO sessions(session_id, owner, updated, ended) VALUES (?, ?, ?, 0) "
                   "ON CONFLICT(session_id) DO UPDATE SET updated = excluded.updated",
        "session_end": "UPDATE sessions SET ended = 1, updated = ? WHERE session_id = ?",
    }

    def __init__(self, path: str, max_age_s: Optional[float] = None, max_bytes: Optional[int] = None,
                 retention_every_s: float = 60.0, busy_timeout_s: float = 30.0,
                 checkpoint_every_s: float = 1.0, prealloc_wal: bool = False) -> None:
        self.path, self.max_age_s, self.max_bytes = path, max_age_s, max_bytes
        self.prealloc_wal = prealloc_wal
        self.retention_every_s, self.busy_timeout_s = retention_every_s, busy_timeout_s
        self.checkpoint_every_s = checkpoint_every_s
        self.stopping = threading.Event()
        self.last_error: Optional[str] = None
        self.counters = {"rows": 0, "commits": 0, "write_errors": 0}
        self._last: dict[str, tuple[int, Optional[bytes]]] = {}  # owner -> (seq, packed prompt + output)
        self._db: Optional[sqlite3.Connection] = None
        self._checkpointer: Optional[threading.Thread] = None
        self._checkpointed = threading.Event()  # the checkpointer finished a pass: the writer completes it
        #: WAL length (frames of a page each) past which the writer completes a checkpoint pass so that the
        #: WAL restarts: 16,384 frames of 4 KiB = 64 MiB (~3 s at 5,000 completions/s)
        self.restart_frames = 16_384
        self._last_retention = time.monotonic()
        #: retention's longest step between two commits, seconds (a pass that has more to do goes on after the
        #: next commit); rows queued meanwhile wait for it
        self.retention_step_s = 0.05
        self._retention_due = False  # a pass is under way
        #: what retention did: units (jobs, sessions) and tombstones deleted, pages handed back
        self.retention_counters = {"jobs": 0, "sessions": 0, "tombstones": 0, "pages_freed": 0}

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **{f"retention_{k}": v for k, v in self.retention_counters.items()},
                "last_error": self.last_error}

    def open(self) -> None:
        if self.prealloc_wal:
            self._prealloc_wal()
        self._db = connect(self.path, self.busy_timeout_s)
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it (see _checkpoints)
        self._checkpointer = threading.Thread(target=self._checkpoints, name="prorl-journal-checkpoint",
                                              daemon=True)
        self._checkpointer.start()

    def close(self) -> None:
        self.stopping.set()
        if self._checkpointer is not None:
            self._checkpointer.join(30)
        if self._db is not None:
            self._db.close()

    def _checkpoints(self) -> None:
        """Copy the WAL into the database every ``checkpoint_every_s`` from a connection of its own (PASSIVE:
        it never waits for the writer), instead of SQLite's automatic checkpoint, which runs inside the commit
        that crosses 1,000 pages and made that commit wait (p99 13 ms at 5,000 completions/s).

        Such a pass takes tens of ms (two fsyncs), and the writer commits meanwhile, so under steady writes it
        never finds the WAL wholly copied, and SQLite restarts the WAL (writes it again from its start) only
        then: the WAL grew without end (93 MB in 4 s at 5,000 completions/s), every commit appended to it, and an
        append that met the pass's fsync waited for it (~15 ms, ext4). So once the WAL is ``restart_frames``
        long, the writer copies the few frames committed during the last pass itself
        (:meth:`_finish_checkpoint`: two small fsyncs, 4-10 ms here, the rows queued meanwhile wait), and its
        next transaction restarts the WAL, which from then on is overwritten in place."""
        db = connect(self.path, self.busy_timeout_s)
        try:
            while not self.stopping.wait(self.checkpoint_every_s):
                try:
                    _, frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if frames >= self.restart_frames:
                        self._checkpointed.set()
                except sqlite3.Error as e:
                    log.debug("journal checkpoint: %s", e)
        finally:
            db.close()

    def wal_prealloc_bytes(self) -> int:
        """How long :meth:`_prealloc_wal` makes the WAL: 1.5 x ``restart_frames`` frames (the WAL grows past
        ``restart_frames`` until the checkpointer's next pass sees it, up to ``checkpoint_every_s`` later: ~23
        MB/s at 5,000 completions/s), each a page and its 24-byte header, after the 32-byte WAL header: 97 MiB
        with 4 KiB pages."""
        page = 4096
        try:
            with open(self.path, "rb") as f:
                head = f.read(18)
            if len(head) == 18 and head.startswith(b"SQLite format 3\0"):
                page = int.from_bytes(head[16:18], "big")
                page = 65536 if page == 1 else page
        except OSError:
            pass
        return 32 + (self.restart_frames * 3 // 2) * (page + 24)

    def _prealloc_wal(self) -> None:
        """Write zeros past the end of the WAL file (creating it) up to :meth:`wal_prealloc_bytes`, and fsync
        them, before the writer opens the journal: commits then overwrite allocated blocks instead of appending
        to the file. An append waits for an fsync of the same file in progress (the checkpointer's, ~15 ms on
        ext4) because it allocates blocks; an overwrite does not. SQLite writes each frame at its offset and
        never reads past the last valid frame (zeros fail the header's magic and the frames' checksums), so the
        zeros are never taken for data; it keeps the file's length when it restarts the WAL
        (``journal_size_limit`` -1, the default) and deletes the file when the last connection closes, so
        this costs the disk only while the journal is open. Only bytes past the current end are written: the
        frames of a WAL left by a crash stay as they are. Failing is not fatal (commits append as before)."""
        target = self.wal_prealloc_bytes()
        try:
            fd = os.open(self.path + "-wal", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            log.warning("journal %s: cannot preallocate the WAL: %s", self.path, e)
            return
        try:
            size = os.fstat(fd).st_size
            if size >= target:
                return
            zeros = bytes(1 << 20)
            off = size
            while off < target:
                off += os.pwrite(fd, zeros[:min(len(zeros), target - off)], off)
            os.fsync(fd)
        except OSError as e:  # e.g. the disk is full: leave what was written (zeros past the end are ignored)
            log.warning("journal %s: cannot preallocate the WAL: %s", self.path, e)
        finally:
            os.close(fd)

    def _finish_checkpoint(self, db: sqlite3.Connection) -> None:
        self._checkpointed.clear()
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as e:
            log.debug("journal checkpoint: %s", e)

    def _completion_row(self, params: tuple) -> Optional[tuple]:
        owner, backend, start, tail, tokens, logprobs, runs, finish, stop, request_params, t = params
        if owner is None:
            return None
        seq, prev = self._last.get(owner, (-1, b""))
        packed = pack_ints(tail)
        out = pack_ints(tokens)
        if start:  # the caller saw the prompt continue the previous prompt + output: ``start`` ids of it
            prefix = start
            new_prev = prev + packed + out if prev is not None and len(prev) == 4 * start else None
        else:  # the whole prompt: store what it shares with the previous prompt + output once
            prefix = len(prev) // 4 if prev and packed.startswith(prev) else 0
            packed = packed[4 * prefix:] if prefix else packed
            new_prev = (prev + packed if prefix else packed) + out
        self._last[owner] = (seq + 1, new_prev)
        if len(self._last) > 100_000:  # owners that never said they ended
            self._last.pop(next(iter(self._last)))
        return (owner, seq + 1, backend, prefix, packed, out, pack_floats(logprobs), _runs_json(runs), finish,
                None if stop is None else json.dumps(stop), request_params, t)

    def write(self, rows: list[tuple[str, Any, float]], on_error: Any = None) -> Optional[list[float]]:
        """Commit ``rows`` (``(kind, params, perf_counter at enqueue)``) in one transaction, retrying a failed
        commit until it goes through (``on_error()`` is called after each failure, ``last_error`` says why)
        or :attr:`stopping` is set. Returns the seconds each row waited from enqueue to commit, or None when
        it gave up (stopping while the commit kept failing)."""
        assert self._db is not None
        db = self._db
        ready: list[tuple[str, Any]] = []
        for kind, params, _ in rows:  # in queue order: a state change never overtakes its job's insert
            if kind == "flush":
                continue
            if kind == "forget":
                self._last.pop(params, None)
                continue
            if kind == "reset":
                self._last.pop(params, None)
                ready.append(("DELETE FROM completions WHERE owner = ?", (params,)))
                continue
            if kind == "completion":
                try:
                    params = self._completion_row(params)
                except (OverflowError, TypeError, ValueError) as e:  # e.g. a token id outside int32
                    self.counters["write_errors"] += 1
                    log.error("journal %s: a completion of %s cannot be stored: %r", self.path, params[0], e)
                    continue
                if params is None:
                    continue
            ready.append((self._SQL[kind], params))
        groups: list[tuple[str, list[Any]]] = []  # runs of one statement: one executemany each
        for sql, params in ready:
            if groups and groups[-1][0] is sql:
                groups[-1][1].append(params)
            else:
                groups.append((sql, [params]))
        delay = 0.05
        while True:  # a failed commit (disk full, a lock held too long) is retried, never dropped: the
            try:     # flushes queued behind it wait, so nothing is answered as recorded that was not
                db.execute("BEGIN")
                for sql, group in groups:
                    db.executemany(sql, group)
                db.execute("COMMIT")
                if self.last_error is not None:
                    log.warning("journal %s: writing again after: %s", self.path, self.last_error)
                self.last_error = None
                break
            except sqlite3.Error as e:
                self.counters["write_errors"] += 1
                if self.last_error is None:
                    log.error("journal %s: a write of %d row(s) failed (%s); retrying", self.path, len(rows), e)
                self.last_error = f"{type(e).__name__}: {e}"
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                if on_error is not None:
                    on_error()
                if self.stopping.wait(delay):
                    return None
                delay = min(1.0, delay * 2)
        now = time.perf_counter()
        self.counters["rows"] += len(rows)
        self.counters["commits"] += 1
        return [now - t for k, _, t in rows if k not in ("forget", "reset", "flush")]

    def after_commit(self) -> None:
        """What the writer does after a commit has been reported: complete a checkpoint pass, a retention step."""
        assert self._db is not None
        if self._checkpointed.is_set():
            self._finish_checkpoint(self._db)
        if time.monotonic() - self._last_retention > self.retention_every_s:
            self._last_retention = time.monotonic()
            self._retention_due = True
        if self._retention_due:
            try:
                self._retention_due = self._retention(self._db)
            except sqlite3.Error as e:
                self._retention_due = False
                log.warning("journal %s: retention failed: %s", self.path, e)

    def _retention(self, db: sqlite3.Connection) -> bool:
        """One retention step of at most about ``retention_step_s``: delete what is older than ``max_age_s``,
        then the oldest ended jobs and sessions (tombstones last) while the live data exceeds ``max_bytes``,
        then hand free pages back (``incremental_vacuum``), each in transactions of a few hundred rows or a
        thousand pages. Returns True when there is more to do (the next commit's step goes on)."""
        deadline = time.monotonic() + self.retention_step_s
        if self.max_age_s is not None:
            cutoff = time.time() - self.max_age_s
            while self._delete_oldest(db, cutoff):
                if time.monotonic() > deadline:
                    return True
            db.execute("DELETE FROM expired WHERE t < ?", (cutoff,))
        if self.max_bytes is not None:
            while self.live_bytes(db) > self.max_bytes:
                if not self._delete_oldest(db, None):
                    # only running jobs are left: tombstones (~100 bytes each) go only once they alone hold an
                    # eighth of the cap, else an over-full journal of running jobs would wipe them all, and with
                    # them the guarantee that a delivered id never runs twice
                    excess = db.execute("SELECT COUNT(*) FROM expired").fetchone()[0] - self.max_bytes // 800
                    n = db.execute("DELETE FROM expired WHERE job_id IN (SELECT job_id FROM expired ORDER BY t "
                                   "LIMIT ?)", (min(1000, excess),)).rowcount if excess > 0 else 0
                    self.retention_counters["tombstones"] += max(0, n)
                    if n <= 0:
                        break
                if time.monotonic() > deadline:
                    return True
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
            while db.execute("PRAGMA freelist_count").fetchone()[0] > 0:
                before = db.execute("PRAGMA page_count").fetchone()[0]
                db.execute("PRAGMA incremental_vacuum(256)").fetchall()  # a row a page: step through them all
                self.retention_counters["pages_freed"] += before - db.execute("PRAGMA page_count").fetchone()[0]
                if time.monotonic() > deadline:
                    return True
        return False

    @staticmethod
    def live_bytes(db: sqlite3.Connection) -> int:
        """Bytes of the database's pages in use (what ``max_bytes`` bounds): its pages less the free ones, as
        this connection sees them (the WAL's newer pages included; the WAL file itself is bounded apart: see
        :meth:`_checkpoints`)."""
        page = db.execute("PRAGMA page_size").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return page * (pages - free)

    def _delete_oldest(self, db: sqlite3.Connection, before: Optional[float], limit: int = 50) -> int:
        """Delete the ``limit`` oldest ended units (finished jobs, ended job-less gateway sessions) last updated
        before ``before`` (None: any), with their completions and gateway rows, in one transaction; a job with
        an unfiltered result leaves a tombstone. Returns how many were deleted."""
        cutoff = float("inf") if before is None else before
        db.execute("BEGIN")
        try:
            # two index scans (jobs_updated, sessions_ended) merged here: a UNION sorted in SQL read every row
            units = sorted(db.execute("SELECT updated, 0, job_id, job_id, filtered FROM jobs WHERE state = 'done' "
                                      "AND updated < ? ORDER BY updated LIMIT ?", (cutoff, limit)).fetchall()
                           + db.execute("SELECT updated, 1, session_id, owner, 0 FROM sessions WHERE ended = 1 "
                                        "AND updated < ? ORDER BY updated LIMIT ?", (cutoff, limit)).fetchall()
                           )[:limit]
            units = [u[1:] for u in units]
            now = time.time()
            db.executemany("DELETE FROM gateway WHERE session_id = ?", [(u[1],) for u in units])
            db.executemany("DELETE FROM completions WHERE owner = ?", [(u[2],) for u in units])
            jobs = [(u[1],) for u in units if u[0] == 0]
            db.executemany("DELETE FROM jobs WHERE job_id = ?", jobs)
            db.executemany("INSERT OR REPLACE INTO expired(job_id, t) VALUES (?, ?)",
                           [(u[1], now) for u in units if u[0] == 0 and not u[3]])
            db.executemany("DELETE FROM sessions WHERE session_id = ?", [(u[1],) for u in units if u[0] == 1])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.retention_counters["jobs"] += len(jobs)
        self.retention_counters["sessions"] += len(units) - len(jobs)
        return len(units)
