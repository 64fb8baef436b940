"""The journal: a durable record, in one SQLite file, of every job's request, state changes and result, every
completion the server requested (exact token ids, logprobs, per-token weight versions) and every gateway
exchange. What a crash must not lose, and what replay, re-grading and export read.

Storage: the standard library's ``sqlite3`` in WAL mode with ``synchronous=NORMAL`` (a committed transaction
survives a crash of the process, SIGKILL included; only a power loss can lose the last ones), one writer
connection owned by one writer thread. Writers on the event loop never touch SQLite: :meth:`Journal.job_submitted`
and friends put a tuple on a queue (microseconds); the thread takes everything queued, writes it in one
transaction and commits, so at 5,000 completions/s a commit carries a few dozen rows. ``Journal.flush()``
waits until what was queued before it is committed (a result is acknowledged to its client only after that,
so a result a client saw is never lost).

Encoding: token ids are stored as little-endian int32 arrays and logprobs as float64 arrays (exact, nothing
truncated); a completion's prompt is stored as the length of the prefix it shares with the same owner's
previous completion (prompt + output, compared as bytes by the writer thread, so a context the chat template
rewrote is stored whole) plus the new ids only, so a 50-turn rollout does not store its context 50 times
(:func:`expand_prompts` rebuilds them).

Retention: ``max_age_s`` (rows of jobs finished longer ago are deleted) and ``max_bytes`` (oldest finished jobs
deleted until the file is under it), applied by the writer every ``retention_every_s``.

Sources: SQLite's WAL documentation (https://sqlite.org/wal.html: readers do not block the writer; with
``synchronous=NORMAL`` a commit is durable against application crashes); rLLM's gateway trace store (SQLite,
WAL, one connection).
"""
from __future__ import annotations

import array
import json
import logging
import os
import queue
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

#: ``PRAGMA user_version`` of the journals this code writes; another version is refused, never guessed at.
SCHEMA_VERSION = 2

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
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    request_hash TEXT NOT NULL,
    request BLOB NOT NULL,
    response BLOB NOT NULL,
    t REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS gateway_session ON gateway(session_id, seq);
"""

_LITTLE = sys.byteorder == "little"


def pack_ints(ids: Sequence[int]) -> bytes:
    """int32 little-endian bytes of ``ids``. Raises OverflowError for an id outside int32."""
    a = array.array("i", ids)
    if not _LITTLE:  # pragma: no cover - every supported platform is little-endian
        a.byteswap()
    return a.tobytes()


def unpack_ints(b: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(b)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tolist()


def pack_floats(xs: Sequence[float]) -> bytes:
    a = array.array("d", xs)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_floats(b: bytes) -> list[float]:
    a = array.array("d")
    a.frombytes(b)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tolist()


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


class Journal:
    """See the module docstring.

    Args:
        path: the SQLite file (its directory is created).
        max_age_s: delete finished jobs (and their completions) older than this; None keeps them.
        max_bytes: keep the file under this many bytes by deleting the oldest finished jobs; None: no cap.
        retention_every_s: how often the writer applies retention.
        max_queue: rows waiting for the writer beyond which a writer call blocks (back-pressure, never loss).

    Raises:
        JournalError: the file cannot be opened as a journal.
    """

    def __init__(self, path: str, *, max_age_s: Optional[float] = None, max_bytes: Optional[int] = None,
                 retention_every_s: float = 60.0, max_queue: int = 1_000_000, readonly: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self._lock_file: Any = None
        if readonly:  # a reader (prorl-journal, a test) of a journal a server may be writing: no lock, no schema
            if not os.path.isfile(self.path):
                raise JournalError(f"no journal at {self.path}")
            self._init_state(max_age_s, max_bytes, retention_every_s, max_queue)
            return
        self.max_age_s, self.max_bytes, self.retention_every_s = max_age_s, max_bytes, retention_every_s
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot open the journal {self.path}: {e}") from e
        self._lock_file = self._take_lock()
        try:
            db = self._connect()
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
            if tables and version != SCHEMA_VERSION:
                db.close()
                raise JournalError(f"the journal {self.path} has schema version {version}, this server writes "
                                   f"version {SCHEMA_VERSION}: move it aside or point journal at a new file")
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
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
        self._q: "queue.Queue[Any]" = queue.Queue(max_queue)
        #: why the journal cannot record any more (a write that kept failing, a full queue); None while it can
        self.failed: Optional[str] = None
        self._last_error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._reader: Optional[sqlite3.Connection] = None
        self._reader_lock = threading.Lock()
        self._last: dict[str, tuple[int, bytes]] = {}  # writer thread: owner -> (seq, packed prompt + output)
        self.checkpoint_every_s = 1.0
        self._stopping = threading.Event()
        self._checkpointer: Optional[threading.Thread] = None
        self.counters = {"rows": 0, "commits": 0, "write_errors": 0}
        #: seconds from a row being queued to its commit, the last 10,000 (benchmarks read it)
        self.latencies: list[float] = []

    def _take_lock(self) -> Any:
        """Hold ``<path>.lock`` exclusively (``flock``) for this Journal's life: two servers writing one journal
        would each take the other's running jobs for interrupted ones and give one job id two results.

        Raises:
            JournalError: another process holds it (its pid is in the message).
        """
        import fcntl

        lock_path = self.path + ".lock"
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise JournalError(f"the journal {self.path} is in use by another process (pid {holder}, lock "
                               f"{lock_path}): give each server its own journal") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the writer thread and the checkpointer (idempotent).

        Raises:
            JournalError: the journal was opened ``readonly``."""
        if self.readonly:
            raise JournalError(f"the journal {self.path} was opened read-only")
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._writer, name="prorl-journal", daemon=True)
            self._thread.start()
            self._checkpointer = threading.Thread(target=self._checkpoints, name="prorl-journal-checkpoint",
                                                  daemon=True)
            self._checkpointer.start()

    def _checkpoints(self) -> None:
        """Copy the WAL into the database every ``checkpoint_every_s`` from a connection of its own (PASSIVE:
        it never waits for the writer), instead of SQLite's automatic checkpoint, which runs inside the commit
        that crosses 1,000 pages and made that commit wait (p99 13 ms at 5,000 completions/s)."""
        db = self._connect()
        try:
            while not self._stopping.wait(self.checkpoint_every_s):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as e:
                    log.debug("journal checkpoint: %s", e)
        finally:
            db.close()

    @property
    def last_error(self) -> Optional[str]:
        """Why the last commit failed, while the writer is retrying it; None when writing works."""
        return self._last_error

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer (a writer still failing gives up after ``timeout_s``)."""
        if self._thread is not None:
            try:
                self._q.put(None, timeout=timeout_s)
            except queue.Full:
                pass
            self._thread.join(timeout_s)
            self._stopping.set()  # a writer still retrying gives up now
            self._thread.join(timeout_s)
            self._thread = None
            if self._checkpointer is not None:
                self._checkpointer.join(timeout_s)
                self._checkpointer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._lock_file is not None and not self._lock_file.closed:
            self._lock_file.close()  # releases the flock

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until every row queued before this call is committed (from a thread; on the event loop use
        ``await asyncio.to_thread(journal.flush)`` or :meth:`aflush`). Returns False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    async def aflush(self, timeout_s: float = 30.0) -> bool:
        """:meth:`flush` for the event loop: waits without blocking it."""
        import asyncio

        if self._thread is None:
            return True
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done() -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(True))

        try:
            self._q.put_nowait(done)
        except queue.Full:
            return False
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ writes (any thread; never block on IO)
    def _put(self, row: tuple) -> None:
        try:
            self._q.put_nowait(row)
        except queue.Full:  # the writer has been failing for a long time: never block the caller
            self.counters["dropped"] = self.counters.get("dropped", 0) + 1
            self.failed = self.failed or (f"{self._q.maxsize} rows wait for a writer that cannot write "
                                          f"({self._last_error}): rows are being dropped")

    def job_submitted(self, job_id: str, handler: str, request_json: bytes) -> None:
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
        ``token_ids``): its first ``len(prompt_ids)`` items at this call are what is recorded; the writer thread
        packs them and finds the prefix shared with the owner's previous completion (bytes compared), so the
        event loop pays O(1) here."""
        self._put(("completion", (owner, backend, prompt_ids, len(prompt_ids), token_ids, logprobs,
                                    version_runs, finish_reason, stop_reason, params, time.time()),
                     time.perf_counter()))

    def reset_owner(self, owner: str) -> None:
        """A new attempt of ``owner`` starts (a resubmitted interrupted job): its journalled completions are
        deleted (read them first: they are what the new attempt replays) and it numbers its turns from 0."""
        self._put(("reset", owner, time.perf_counter()))

    def forget_owner(self, owner: str) -> None:
        """The owner ended: no further completion of it will come (its previous context is dropped)."""
        self._put(("forget", owner, 0.0))

    def gateway_exchange(self, session_id: str, seq: int, request_hash: str, request: bytes,
                         response: bytes) -> None:
        self._put(("gateway", (session_id, seq, request_hash, request, response, time.time()),
                     time.perf_counter()))

    # ------------------------------------------------------------------ writer thread
    _SQL = {
        "job": "INSERT OR REPLACE INTO jobs(job_id, handler, request, state, submitted, updated) "
               "VALUES (?, ?, ?, ?, ?, ?)",
        "state": "UPDATE jobs SET state = ?, updated = ? WHERE job_id = ? AND state != 'done'",
        "result": "UPDATE jobs SET state = 'done', result = ?, filtered = ?, updated = ? WHERE job_id = ?",
        "completion": "INSERT INTO completions(owner, seq, backend, prefix_len, prompt_tail, token_ids, logprobs, "
                      "version_runs, finish_reason, stop_reason, params, t) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        "gateway": "INSERT INTO gateway(session_id, seq, request_hash, request, response, t) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
    }

    def _writer(self) -> None:
        db = self._connect()
        db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it (see _checkpoints)
        last_retention = time.monotonic()
        stop = False
        while not stop:
            item = self._q.get()
            batch = [item]
            while len(batch) < 5000:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            rows: list[tuple[str, tuple, float]] = []
            waiters = []
            for x in batch:
                if x is None:
                    stop = True
                elif isinstance(x, tuple):
                    rows.append(x)
                else:
                    waiters.append(x)
            if rows:
                try:
                    self._commit(db, rows)
                except Exception:  # the writer must outlive any bad row: nothing after it may be lost
                    self.counters["write_errors"] += 1
                    log.exception("journal %s: writing %d row(s) failed", self.path, len(rows))
            for w in waiters:
                w.set() if isinstance(w, threading.Event) else w()
            if time.monotonic() - last_retention > self.retention_every_s:
                last_retention = time.monotonic()
                self._retention(db)
        db.close()

    def _completion_row(self, params: tuple) -> Optional[tuple]:
        owner, backend, prompt, n, tokens, logprobs, runs, finish, stop, request_params, t = params
        if owner is None:
            return None
        packed = pack_ints(prompt[:n])
        seq, prev = self._last.get(owner, (-1, b""))
        prefix = len(prev) if prev and packed.startswith(prev) else 0
        out = pack_ints(tokens)
        self._last[owner] = (seq + 1, packed + out)
        if len(self._last) > 100_000:  # owners that never said they ended
            self._last.pop(next(iter(self._last)))
        return (owner, seq + 1, backend, prefix // 4, packed[prefix:], out, pack_floats(logprobs),
                json.dumps(runs, separators=(",", ":")), finish,
                None if stop is None else json.dumps(stop), request_params, t)

    def _commit(self, db: sqlite3.Connection, rows: list[tuple[str, Any, float]]) -> None:
        ready: list[tuple[str, Any]] = []
        for kind, params, _ in rows:  # in queue order: a state change never overtakes its job's insert
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
            ready.append((self._SQL[kind], params))
        delay = 0.05
        while True:  # a failed commit (disk full, a lock held too long) is retried, never dropped: the
            try:     # flushes queued behind it wait, so nothing is answered as recorded that was not
                db.execute("BEGIN")
                for sql, params in ready:
                    db.execute(sql, params)
                db.execute("COMMIT")
                if self._last_error is not None:
                    log.warning("journal %s: writing again after: %s", self.path, self._last_error)
                self._last_error = None
                break
            except sqlite3.Error as e:
                self.counters["write_errors"] += 1
                if self._last_error is None:
                    log.error("journal %s: a write of %d row(s) failed (%s); retrying", self.path, len(rows), e)
                self._last_error = f"{type(e).__name__}: {e}"
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                if self._stopping.is_set():
                    self.failed = f"closed while its writes failed ({self._last_error})"
                    return
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        now = time.perf_counter()
        self.counters["rows"] += len(rows)
        self.counters["commits"] += 1
        lat = self.latencies
        lat.extend(now - t for k, _, t in rows if k not in ("forget", "reset"))
        if len(lat) > 20_000:
            del lat[:-10_000]

    def _retention(self, db: sqlite3.Connection) -> None:
        try:
            if self.max_age_s is not None:
                self._delete_done(db, "updated < ?", (time.time() - self.max_age_s,))
            if self.max_bytes is not None:
                while self.size_bytes() > self.max_bytes:
                    n = self._delete_done(db, "job_id IN (SELECT job_id FROM jobs WHERE state = 'done' "
                                          "ORDER BY updated LIMIT 1000)", ())
                    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    db.execute("VACUUM")
                    if n == 0:
                        break
        except sqlite3.Error as e:
            log.warning("journal %s: retention failed: %s", self.path, e)

    @staticmethod
    def _delete_done(db: sqlite3.Connection, where: str, params: tuple) -> int:
        db.execute("BEGIN")
        ids = [r[0] for r in db.execute(f"SELECT job_id FROM jobs WHERE state = 'done' AND {where}", params)]
        db.executemany("DELETE FROM completions WHERE owner = ?", [(i,) for i in ids])
        db.executemany("DELETE FROM jobs WHERE job_id = ?", [(i,) for i in ids])
        db.execute("COMMIT")
        return len(ids)

    def size_bytes(self) -> int:
        """The journal's size on disk (the database and its WAL)."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(self.path + suffix)
            except OSError:
                pass
        return total

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

    def gateway_exchanges(self, session_id: str) -> list[tuple[int, str, bytes, bytes]]:
        """``(seq, request_hash, request, response)`` of a gateway session, in order."""
        with self._reader_lock:
            return self._read().execute("SELECT seq, request_hash, request, response FROM gateway WHERE "
                                        "session_id = ? ORDER BY seq", (session_id,)).fetchall()


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
