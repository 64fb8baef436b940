"""Fleet membership with leases (issue #24): each server process holds one record in a shared directory.

A fleet directory (``--fleet-dir DIR``, on the shared file system the Slurm launcher already uses) holds::

    DIR/members/<member_id>.json   one record per live server process (this module writes and renews it)
    DIR/END                        the end sentinel: the trainer is done, every member exits (``write_end``;
                                   signed like a record, see ``end_is_proven``)
    DIR/token                      the fleet's bearer token (mode 0600; written by the launcher)

A record (:class:`MemberRecord`, JSON, format version 1) says where the member is (``url``, ``node``, Slurm
``job_id``/``step_id``, ``pid``), which Slurm ``cluster`` (``$SLURM_CLUSTER_NAME``: a reader asks that
controller whether the job and step still run), whether it takes jobs (``state``: ``active`` or ``draining``), how much
(``capacity``: run workers; ``backends``: LLM backends in rotation), which weights it serves
(``weight_version``), and its lease: ``seq`` (a counter the writer increments at every renewal), ``ttl_s``,
and ``renewed_at``/``expires_at`` on the writer's wall clock. Records are written atomically (a temporary file
in ``members/``, then ``os.replace``), so a reader sees the old record or the new one, never half of one. The
lease is renewed every ``ttl_s / 3`` and at once when the state or the backends change; the record is removed
when the server exits cleanly. A member killed with SIGKILL leaves its record behind: readers see its ``seq``
stop moving and drop it after ``ttl_s`` (see :mod:`trainer_plugins.fleet` for how readers judge a lease
without trusting the writer's clock), and the next member started on that node removes it (its pid is gone).

Proof of membership (issue #33): the directory is shared node state another local user may be able to write
(project directories are often group-writable), and a reader sends the fleet's bearer token with every job, so a
record is trusted only when it proves its writer. With a fleet token (the server's ``token`` setting, which the
launcher also writes to ``DIR/token``) every record carries ``sig``: HMAC-SHA256, keyed with the token, over the
record's canonical bytes (:func:`canonical_record_bytes`); a reader holding the token checks it with
``hmac.compare_digest`` (:func:`verify_record`), so a record nobody holding the token wrote, or one whose address a
forger rewrote, is refused. Without a token a reader trusts only records it could have written itself: files of
its own uid in a ``members/`` directory that it owns and that no other user can write (see
:mod:`trainer_plugins.fleet`). ``members/`` is created ``0755`` (not group-writable whatever the umask); a fleet
of servers running under several uids needs a token.

All file I/O runs in a thread (``asyncio.to_thread``), never on the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, Optional

import psutil
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MEMBERS = "members"
END_SENTINEL = "END"
TOKEN_FILE = "token"
DEFAULT_TTL_S = 5.0

State = Literal["active", "draining"]


class MemberRecord(BaseModel):
    """One member's record in ``DIR/members/<member_id>.json`` (see the module docstring). Times are unix
    seconds on the writer's clock; ``seq`` increases by one at every renewal."""

    model_config = ConfigDict(extra="ignore")

    version: int = FORMAT_VERSION
    member_id: str
    url: str
    host: str
    port: int
    pid: int
    node: str
    cluster: Optional[str] = None
    job_id: Optional[str] = None
    step_id: Optional[str] = None
    state: State = "active"
    capacity: int = Field(default=1, ge=0, description="jobs it runs at once (its run workers)")
    backends: int = Field(default=0, ge=0, description="LLM backends in its rotation")
    weight_version: Optional[int] = None
    in_flight: int = 0
    seq: int = 0
    ttl_s: float = DEFAULT_TTL_S
    started_at: float = 0.0
    renewed_at: float = 0.0
    expires_at: float = 0.0
    sig: Optional[str] = Field(default=None, description="HMAC-SHA256 (hex) of the record with the fleet token "
                               "(see canonical_record_bytes); None when the writer has no token")


#: Domain separation: a record's signature cannot be replayed as any other HMAC made with the fleet token.
SIGNATURE_CONTEXT = b"prorl-fleet-record-v1\n"


class UnverifiedRecordError(ValueError):
    """A record that does not prove its writer holds the fleet token (no ``sig``, or a wrong one)."""


def canonical_record_bytes(fields: dict) -> bytes:
    """The bytes a record's signature covers: every field but ``sig``, as JSON with sorted keys, no spaces,
    ASCII only. ``fields`` is the record as parsed from its file (``json.loads``), so a field this version
    does not know is covered too."""
    body = {k: v for k, v in fields.items() if k != "sig"}
    return SIGNATURE_CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                          allow_nan=True).encode()


def sign_fields(fields: dict, token: str) -> str:
    """HMAC-SHA256 of :func:`canonical_record_bytes` keyed with ``token`` (UTF-8), as 64 hex characters."""
    return hmac.new(token.encode(), canonical_record_bytes(fields), hashlib.sha256).hexdigest()


def record_bytes(record: MemberRecord, token: Optional[str] = None) -> bytes:
    """The file content of ``record``: JSON, signed with ``token`` when one is given (``sig`` set)."""
    fields = record.model_dump(mode="json", exclude={"sig"})
    if token:
        fields["sig"] = sign_fields(fields, token)
    return json.dumps(fields, separators=(",", ":")).encode()


def verify_record(data: bytes, token: Optional[str]) -> MemberRecord:
    """Parse a record file's bytes (at most :data:`MAX_RECORD_BYTES`, read by :func:`read_small_file`) and, when
    ``token`` is given, check its signature in constant time.

    Raises:
        UnverifiedRecordError: ``token`` is given and the record carries no ``sig`` or a wrong one.
        ValueError: not JSON, nested too deep, or not a record (pydantic.ValidationError is a ValueError).
    """
    try:
        fields = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    if token:
        sig = fields.get("sig")
        if not isinstance(sig, str):
            raise UnverifiedRecordError("unsigned record (the fleet has a token)")
        if not hmac.compare_digest(sig.encode("ascii", "replace"), sign_fields(fields, token).encode()):
            raise UnverifiedRecordError("signature does not match the fleet token")
    return MemberRecord.model_validate(fields)


def node_name() -> str:
    """``$SLURMD_NODENAME`` inside a Slurm step, else the short host name."""
    return (os.environ.get("SLURMD_NODENAME") or socket.gethostname()).split(".", 1)[0]


def members_dir(fleet_dir: str | os.PathLike) -> Path:
    return Path(fleet_dir) / MEMBERS


class FleetDirError(OSError):
    """The fleet directory or ``members/`` is not safe to use: another local user could rename or replace what
    this process writes there (see :func:`secure_fleet_dir`), or ``members/`` is not this user's directory."""


def _sticky(path: Path, st: os.stat_result) -> None:
    """Add the sticky bit to a directory this uid owns (the permission bits otherwise kept: a group-writable
    project directory stays group-writable): in a sticky directory only a file's owner (or the directory's)
    may rename or delete it, so a co-tenant who can write the directory cannot rename the trainer's END,
    a member's record, or ``members/`` itself."""
    if not st.st_mode & stat.S_ISVTX:
        os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)


def secure_fleet_dir(fleet_dir: str | os.PathLike) -> Path:
    """Create the fleet directory if needed and make it safe to share (issue #33), returning it.

    A directory this uid owns gets the sticky bit (mode 1770/1775/1755 style: its group write, if any, is
    kept). One owned by another user that other users may write and that lacks the sticky bit is refused:
    anyone who can write it could rename the END sentinel or ``members/`` away (a fleet that never ends,
    records written into a directory of theirs) or put an old END back (a fleet stopped by a replay); its
    owner fixes it with ``chmod +t DIR``. Blocking.

    Raises:
        FleetDirError: the directory is not safe (the message names it and the fix). OSError: it cannot be
            created or read.
    """
    d = Path(fleet_dir)
    d.mkdir(parents=True, exist_ok=True)
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise FleetDirError(f"the fleet directory {d} is not a directory")
    if st.st_uid == os.geteuid():
        _sticky(d, st)
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise FleetDirError(
            f"the fleet directory {d} has mode {stat.S_IMODE(st.st_mode):04o} and belongs to uid {st.st_uid}: "
            f"other users can write it and it has no sticky bit, so any of them could rename the end sentinel or "
            f"members/ away or put an old END back. Its owner can run `chmod +t {d}`; or use a directory of "
            f"your own")
    return d


def _members_fd(fleet_dir: str | os.PathLike) -> int:
    """A descriptor of ``DIR/members`` (created ``1755`` if missing), checked to be a real directory of this
    uid: a renewal then writes into the directory that was checked, whatever is renamed meanwhile.

    Raises:
        FleetDirError: ``members/`` is a file, a link, or another user's directory.
    """
    d = members_dir(fleet_dir)
    try:
        d.mkdir(mode=0o755)  # never group-writable by umask: a reader without a token checks that
    except FileExistsError:
        pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise FleetDirError(e.errno, f"{d} is not a directory (a file or a link was put in its place): this "
                                "member cannot renew its lease, readers drop it") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise FleetDirError(errno.EPERM, f"{d} belongs to uid {st.st_uid}, not to this user (uid "
                                f"{os.geteuid()}): records written there could be removed by its owner; "
                                "remove it (it is recreated)")
        if stat.S_IMODE(st.st_mode) != 0o1755:  # umask-proof, and sticky: see _sticky
            os.fchmod(fd, 0o1755)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_record(fleet_dir: str | os.PathLike, record: MemberRecord, token: Optional[str] = None) -> Path:
    """Write ``record`` atomically to ``DIR/members/<member_id>.json`` (``members/`` created with mode 1755,
    and checked to be this user's directory: :func:`_members_fd`), signed with ``token`` when one is given
    (:func:`record_bytes`). Blocking.

    Raises:
        FleetDirError: ``members/`` is not a directory of this user. OSError: the write failed.
    """
    d = members_dir(fleet_dir)
    d.parent.mkdir(parents=True, exist_ok=True)
    dfd = _members_fd(fleet_dir)
    name = f"{record.member_id}.json"
    tmp = f".{record.member_id}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record_bytes(record, token))
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)
    return d / name


def end_marker(fleet_dir: str | os.PathLike) -> Optional[tuple[int, int]]:
    """Identity ``(inode, mtime_ns)`` of the end sentinel, or None when there is none."""
    try:
        st = os.stat(Path(fleet_dir) / END_SENTINEL)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


#: Domain separation of the end sentinel's signature (a record's signature is not an END's, nor the reverse).
END_SIGNATURE_CONTEXT = b"prorl-fleet-end-v1\n"


def fleet_token(fleet_dir: str | os.PathLike) -> Optional[str]:
    """The fleet's token as a trainer finds it: ``DIR/token`` when it is this user's and private
    (:func:`read_token_file` with ``require_owner``), else ``$PRORL_TOKEN``, else None. Blocking; raises nothing."""
    try:
        return read_token_file(Path(fleet_dir) / TOKEN_FILE, require_owner=True)
    except (OSError, ValueError):
        return os.environ.get("PRORL_TOKEN") or None


def _end_signature(fields: dict, token: str) -> str:
    body = {k: v for k, v in fields.items() if k != "sig"}
    data = END_SIGNATURE_CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), data, hashlib.sha256).hexdigest()


def write_end(fleet_dir: str | os.PathLike, reason: str = "the trainer ended", token: Optional[str] = None) -> Path:
    """Write the end sentinel ``DIR/END`` (atomically): every member of the fleet exits, and the launcher
    releases the allocation. It is signed with ``token`` (default: :func:`fleet_token`), so members holding the
    token ignore an END another local user wrote (:func:`end_is_proven`). The signed content carries ``at`` (the writer's wall clock): a member
    accepts an END only if it was written after the member started (see :func:`end_is_proven`), so a genuine
    END of an earlier run put back in the directory does not stop this run. Blocking.

    Raises:
        FleetDirError: the directory is not safe to share (:func:`secure_fleet_dir`).
    """
    d = secure_fleet_dir(fleet_dir)
    token = token or fleet_token(d)
    fields: dict = {"reason": reason, "at": time.time(), "pid": os.getpid(), "node": node_name()}
    if token:
        fields["sig"] = _end_signature(fields, token)
    fd, tmp = tempfile.mkstemp(prefix=".END.", dir=d)
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    path = d / END_SENTINEL
    os.replace(tmp, path)
    return path


#: How far a trainer's clock may run behind a member's, seconds, when an END's signed ``at`` is compared with the
#: member's start (a second check, on the shared file system's own clock, needs no allowance: see end_is_proven)
END_CLOCK_SKEW_S = 30.0


def end_is_proven(fleet_dir: str | os.PathLike, token: Optional[str], *, started_at: Optional[float] = None,
                  start_mtime_ns: Optional[int] = None) -> tuple[bool, str]:
    """Whether ``DIR/END`` was written by a holder of ``token`` (its ``sig``) or, with no token, by this uid
    (owner read on the open file), for the run of a member that started at ``started_at`` (unix seconds, its
    wall clock) and whose first record has mtime ``start_mtime_ns``. Returns ``(proven, why not)``.

    An END is bound to its run twice: its signed ``at`` must not be more than :data:`END_CLOCK_SKEW_S` before
    ``started_at`` (a copy of an old END keeps its old signed time), and the file's own mtime must not be before
    ``start_mtime_ns`` (both times are the shared file system's, so no clock skew enters; a rename keeps a
    file's mtime and only its owner can set it, so an END of an earlier run renamed aside and put back is
    refused). Blocking; raises nothing."""
    try:
        data, st = _read_small(Path(fleet_dir) / END_SENTINEL, owner=None if token else os.geteuid())
        fields = json.loads(data)
        if not isinstance(fields, dict):
            return False, "not a JSON object"
        if token:
            sig = fields.get("sig")
            if not isinstance(sig, str):
                return False, "unsigned (the fleet has a token)"
            if not hmac.compare_digest(sig.encode("ascii", "replace"), _end_signature(fields, token).encode()):
                return False, "signature does not match the fleet token"
        at = fields.get("at")
        if started_at is not None and (not isinstance(at, (int, float)) or at < started_at - END_CLOCK_SKEW_S):
            return False, (f"written at {at!r}, before this member started ({started_at:.3f}): an END of an "
                           "earlier run")
        if start_mtime_ns is not None and st.st_mtime_ns < start_mtime_ns:
            return False, "the file is older than this member's first record: an END of an earlier run"
        return True, ""
    except (OSError, ValueError, RecursionError) as e:  # UnverifiedRecordError (another uid's) included
        return False, str(e).splitlines()[0][:200] if str(e) else type(e).__name__


#: The largest record (or token file) a reader takes, bytes: a record is about 1 KB.
MAX_RECORD_BYTES = 1 << 20


def read_small_file(path: str | os.PathLike, limit: int = MAX_RECORD_BYTES, *, dir_fd: Optional[int] = None,
                    owner: Optional[int] = None) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes, read without ever blocking on it.

    Anyone who can write the shared directory can put anything there: a FIFO (whose open blocks until a writer
    comes: a reader thread, or the server at start, hung for good), a symlink to ``/dev/zero`` (endless), a
    40 MB file. Records are written by rename, never as links, so a symlink is refused too.

    Args:
        dir_fd: open ``path`` relative to this directory descriptor (the directory whose owner was checked).
        owner: the uid the file must belong to (checked on the open file, so a swap after a check cannot fool it).

    Raises:
        OSError: it cannot be opened (a symlink: ``ELOOP``). UnverifiedRecordError: not ``owner``'s.
        ValueError: not a regular file, or over ``limit``.
    """
    return _read_small(path, limit, dir_fd=dir_fd, owner=owner)[0]


def _read_small(path: str | os.PathLike, limit: int = MAX_RECORD_BYTES, *, dir_fd: Optional[int] = None,
                owner: Optional[int] = None) -> tuple[bytes, os.stat_result]:
    """:func:`read_small_file` that also gives the open file's status."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if owner is not None and st.st_uid != owner:
            raise UnverifiedRecordError(f"written by uid {st.st_uid}, not by this user (uid {owner}), and the "
                                        "fleet has no token to prove it")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise ValueError(f"over {limit} bytes")
        return data, st
    finally:
        os.close(fd)


#: The usage error for a token given in argv (prorl-server, prorl-run): a command line is no place for a secret.
TOKEN_IN_ARGV = ("--token VALUE is refused: a command line is readable by every local user (ps, "
                 "/proc/PID/cmdline). Give the token with --token-file PATH (a file of mode 600) or the "
                 "PRORL_TOKEN environment variable")


def read_token_file(path: str | os.PathLike, *, require_owner: bool = False) -> str:
    """The secret in ``path`` (``prorl-server --token-file``, ``prorl-run --token-file``, a fleet's ``DIR/token``),
    stripped of surrounding white space, read without blocking (a FIFO or a device is refused, not waited on).

    A secret another user can read is no secret: the file must be a regular file with no permission bits for
    group or other (``chmod 600``). ``require_owner``: it must also belong to this process's effective uid and
    not be a symlink (a file in a shared directory: another user could have put it there, and root reads any
    file, whoever owns it).

    Raises:
        ValueError: not a regular file, readable or writable by group/other, not ours (``require_owner``),
            over 64 KiB, not UTF-8, or empty. OSError: it cannot be opened (missing; a symlink with
            ``require_owner``: ``ELOOP``).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if require_owner else 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read it "
                             f"(chmod 600 {path})")
        if require_owner and st.st_uid != os.geteuid():
            raise ValueError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        data = os.read(fd, (64 << 10) + 1)
    finally:
        os.close(fd)
    if len(data) > 64 << 10:
        raise ValueError(f"{path} is over 64 KiB: not a token")
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def clear_end(fleet_dir: str | os.PathLike) -> bool:
    """Remove an end sentinel left by an earlier run (a new trainer starts on the directory). True if one was."""
    try:
        (Path(fleet_dir) / END_SENTINEL).unlink()
        return True
    except FileNotFoundError:
        return False


def prune_dead_on_node(fleet_dir: str | os.PathLike, node: str) -> int:
    """Remove the records of this node whose process is gone (members killed with SIGKILL earlier). Records of
    other nodes are left to their own node: a pid means nothing elsewhere. Returns how many were removed."""
    removed = 0
    d = members_dir(fleet_dir)
    try:
        names = [n for n in os.listdir(d) if n.endswith(".json")]
    except OSError:
        return 0
    for name in names:
        path = d / name
        try:
            rec = MemberRecord.model_validate_json(read_small_file(path))
        except (OSError, ValueError):
            continue
        if rec.node == node and not psutil.pid_exists(rec.pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class Membership:
    """This server process's record in a fleet directory, renewed until :meth:`close`.

    Args:
        fleet_dir: the fleet directory. url/host/port: where clients reach this process.
        ttl_s: lease length, seconds (renewed every ``ttl_s / 3``). capacity: jobs it runs at once.
        status: ``() -> (backends in rotation, weight_version, jobs in flight)``, read at every renewal.
        on_end: called once when an end sentinel appears that was not there when this member started and that
            proves its writer (:func:`end_is_proven`: signed with ``token``, or, without one, this uid's).
        token: the fleet's bearer token (the server's own): every record is signed with it, so readers holding
            it can tell this record from a forged one. None: unsigned (readers then trust only their own uid).
        on_lost: called once, with the reason, when the lease could not be renewed for ``ttl_s`` because
            ``members/`` is not this user's directory (:class:`FleetDirError`): readers have dropped this member,
            so it exits saying why instead of serving outside the fleet. Default: ``on_end``.

    :attr:`problem` says why the last renewal failed (None while renewals succeed), for ``/health``.
    """

    def __init__(self, fleet_dir: str | os.PathLike, *, url: str, host: str, port: int, ttl_s: float = DEFAULT_TTL_S,
                 capacity: int = 1, status: Optional[Callable[[], tuple[int, Optional[int], int]]] = None,
                 on_end: Optional[Callable[[], None]] = None, token: Optional[str] = None,
                 on_lost: Optional[Callable[[str], None]] = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"fleet lease ttl must be > 0 seconds, got {ttl_s}")
        self.fleet_dir = Path(fleet_dir)
        node = node_name()
        self.record = MemberRecord(
            member_id=f"{node}-{os.getpid()}-{port}", url=url, host=host, port=port, pid=os.getpid(), node=node,
            cluster=os.environ.get("SLURM_CLUSTER_NAME"), job_id=os.environ.get("SLURM_JOB_ID"),
            step_id=os.environ.get("SLURM_STEP_ID"), capacity=capacity,
            ttl_s=ttl_s, started_at=time.time())
        self.ttl_s = ttl_s
        self._token = token
        self._status = status
        self._on_end = on_end
        self._end_at_start: Optional[tuple[int, int]] = None
        self._end_refused: Optional[tuple[int, int]] = None  # an END seen and not proven (logged once)
        self._on_lost = on_lost
        self._start_mtime_ns: Optional[int] = None  # mtime of the first record: the file system's clock at start
        #: why the last renewal failed (None while they succeed)
        self.problem: Optional[str] = None
        self._failing_since: Optional[float] = None
        self._task: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self._closed = False
        self._dirty = False

    @property
    def path(self) -> Path:
        return members_dir(self.fleet_dir) / f"{self.record.member_id}.json"

    @property
    def state(self) -> str:
        return self.record.state

    async def start(self) -> None:
        """Check the fleet directory (:func:`secure_fleet_dir`), prune dead records of this node, write the first
        record, start renewing.

        Raises:
            FleetDirError: the directory or ``members/`` is not safe to use (the message says why and the fix).
        """
        await asyncio.to_thread(secure_fleet_dir, self.fleet_dir)
        pruned = await asyncio.to_thread(prune_dead_on_node, self.fleet_dir, self.record.node)
        if pruned:
            log.info("fleet: removed %d record(s) of dead members on %s", pruned, self.record.node)
        self._end_at_start = await asyncio.to_thread(end_marker, self.fleet_dir)
        await self._renew()
        self._start_mtime_ns = (await asyncio.to_thread(os.stat, self.path)).st_mtime_ns
        self._task = asyncio.create_task(self._renew_forever(), name="fleet-lease")
        log.info("fleet: member %s (%s) joined %s, lease %g s", self.record.member_id, self.record.url,
                 self.fleet_dir, self.ttl_s)

    def set_state(self, state: State) -> None:
        """Change the state; the record is rewritten at once (by the renewal task)."""
        if self.record.state != state:
            self.record = self.record.model_copy(update={"state": state})
            self._dirty = True
            self._wake.set()

    async def set_state_now(self, state: State) -> None:
        """Change the state and write the record before returning (drain: clients must see it first)."""
        self.record = self.record.model_copy(update={"state": state})
        await self._renew()

    async def _renew(self) -> None:
        now = time.time()
        update = {"seq": self.record.seq + 1, "renewed_at": now, "expires_at": now + self.ttl_s}
        if self._status is not None:
            backends, version, in_flight = self._status()
            update.update(backends=backends, weight_version=version, in_flight=in_flight)
        self.record = self.record.model_copy(update=update)
        if not self._closed:
            await asyncio.to_thread(write_record, self.fleet_dir, self.record, self._token)

    def _watched(self) -> tuple[int, Optional[int]]:
        if self._status is None:
            return 0, None
        backends, version, _ = self._status()
        return backends, version

    async def _renew_forever(self) -> None:
        period = self.ttl_s / 3
        last = time.monotonic()
        seen = self._watched()
        last_end_check = 0.0
        while not self._closed:
            # wake early for a state change; look at the backends every 0.2 s so a registration is published
            # at once (a joining server gets its first job within a poll of the clients)
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, min(0.2, period - (time.monotonic() - last))))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            now_seen = self._watched()
            if self._closed:
                return
            if now_seen != seen or time.monotonic() - last >= period or self._dirty:
                seen, self._dirty = now_seen, False
                try:
                    await self._renew()
                    if self.problem is not None:
                        log.warning("fleet: the lease of %s is renewed again", self.record.member_id)
                    self.problem, self._failing_since = None, None
                except OSError as e:  # a shared file system hiccup: the next renewal tries again
                    self._renewal_failed(e)
                last = time.monotonic()
            if time.monotonic() - last_end_check < 1.0:  # a stat on the shared file system: once a second
                continue
            last_end_check = time.monotonic()
            marker = await asyncio.to_thread(end_marker, self.fleet_dir)
            if marker is not None and marker != self._end_at_start and self._on_end is not None:
                if marker == self._end_refused:
                    continue
                proven, why = await asyncio.to_thread(end_is_proven, self.fleet_dir, self._token,
                                                      started_at=self.record.started_at,
                                                      start_mtime_ns=self._start_mtime_ns)
                if not proven:  # a co-tenant's END would stop the fleet: only the trainer's counts
                    self._end_refused = marker
                    log.warning("fleet: ignoring the end sentinel %s: %s", self.fleet_dir / END_SENTINEL, why)
                    continue
                log.warning("fleet: end sentinel %s: the trainer ended; this member exits",
                            self.fleet_dir / END_SENTINEL)
                on_end, self._on_end = self._on_end, None
                on_end()

    def _renewal_failed(self, e: OSError) -> None:
        """Say why a renewal failed (an error once per reason, never silently out of the fleet); after ``ttl_s``
        of :class:`FleetDirError` (readers have dropped this member and retrying cannot help), call ``on_lost``."""
        why = str(e) or repr(e)
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if why != self.problem:
            self.problem = why
            log.error("fleet: could not renew the lease of %s: %s", self.record.member_id, why)
        if isinstance(e, FleetDirError) and now - self._failing_since >= self.ttl_s:
            lost, on_end = self._on_lost, self._on_end
            if lost is None and on_end is not None:
                lost = lambda reason: on_end()  # noqa: E731
            self._on_lost = self._on_end = None
            if lost is not None:
                log.error("fleet: %s is out of the fleet (no renewal for %.1f s): %s; this member exits",
                          self.record.member_id, now - self._failing_since, why)
                lost(why)

    async def close(self) -> None:
        """Stop renewing and remove the record (a clean exit). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.to_thread(self.path.unlink, True)
        except OSError as e:  # members/ replaced (see _renewal_failed): nothing of ours to remove
            log.warning("fleet: could not remove the record of %s: %s", self.record.member_id, e)
        log.info("fleet: member %s left %s", self.record.member_id, self.fleet_dir)


class FleetControl:
    """A server's part in draining (``SIGTERM`` in a fleet, ``POST /drain``) and its fleet record.

    ``draining``: new jobs are refused (``/process`` answers 503 ``draining``) while the jobs held run to their
    end; ``exit_requested`` is set when the server should leave once they have (or at the drain deadline).
    ``membership`` is attached by ``prorl-server`` once it listens (None without ``--fleet-dir``).
    """

    def __init__(self) -> None:
        self.draining = False
        self.membership: Optional[Membership] = None
        self._exit: Optional[asyncio.Event] = None

    @property
    def exit_requested(self) -> asyncio.Event:
        if self._exit is None:
            self._exit = asyncio.Event()
        return self._exit

    async def start_drain(self) -> None:
        """Refuse new jobs from now on, publish ``draining`` in the record before returning, ask to exit."""
        self.draining = True
        if self.membership is not None:
            try:
                await self.membership.set_state_now("draining")
            except OSError as e:
                log.warning("fleet: could not write the draining record: %r (clients learn it from a 503)", e)
        self.exit_requested.set()

    async def wait_drained(self, in_flight: Callable[[], int], timeout_s: float,
                           stop_now: Optional[asyncio.Event] = None, poll_s: float = 0.1) -> int:
        """Wait until ``in_flight()`` is 0, ``timeout_s`` seconds pass, or ``stop_now`` is set. Returns the
        jobs still held (cancelled by the shutdown that follows)."""
        deadline = time.monotonic() + timeout_s
        while in_flight() > 0 and time.monotonic() < deadline and not (stop_now and stop_now.is_set()):
            await asyncio.sleep(poll_s)
        left = in_flight()
        if left:
            log.warning("drain: %d job(s) still running after %g s: they are cancelled", left, timeout_s)
        else:
            log.info("drain: every job finished; leaving")
        return left
