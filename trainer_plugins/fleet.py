"""Follow a fleet of rollout servers as it grows and shrinks (issue #24): the reader of the leased records that
each ``prorl-server --fleet-dir DIR`` process keeps in ``DIR/members/`` (format: :mod:`prorl_server.membership`).

A :class:`Fleet` is a live ``Sequence[str]`` of the rollout server URLs that may get new jobs now, so every
caller that takes a server list (``JobSubmitter.run``, ``RolloutClient``, the TRL and verl plugins,
``prorl-run``) follows the membership with no restart when given one (``open_fleet(DIR)``, or the directory's
path wherever a ``servers.json`` path is accepted). A background thread re-reads the directory every ``poll_s``
(0.25 s): it lists ``members/`` when the directory's mtime changed (and at least once a second, for file
systems with a coarse mtime) and parses a record only when its file changed (inode, mtime, size). Nothing here
runs on an event loop.

Which members get new jobs: those whose record says ``active`` (not ``draining``), whose lease is live, and
that no request of this process found dead since. Defined outcomes:

================================================  =========================================================
what happens                                      outcome
================================================  =========================================================
a new record appears (a server joined)            routable at the next poll (<= ``poll_s``)
``state: draining``, or a 503 ``draining``        out at once; its jobs finish there (never aborted)
the lease stops moving (SIGKILL, node lost)       out ``ttl_s`` after the last renewal this reader saw
                                                  (<= ``ttl_s + poll_s``, under 2 x TTL); its open requests
                                                  here end as filtered results, resubmitted elsewhere
a request gets no answer (refused, reset)         out at once (:meth:`Fleet.mark_failed`); back only after
                                                  its lease renewed and ``GET /health`` answered (a probe
                                                  every ``probe_interval_s``): a server that renews its
                                                  lease but answers nothing stays out
a record that is not JSON / not a record          skipped (logged once); a member known under that file
(half-written by a foreign tool, corrupt)         keeps its last good record, whose lease then runs out
a record that does not prove its writer (see      skipped, one log line each: never routed to, never sent
"Proof of membership" below): unsigned, a wrong   the token, never probed; a member known under that file
signature, written by another uid, or its         keeps its last proven record, whose lease then runs out
``members/`` is writable by other users
a record of this node whose pid is gone           out at once (it died; its lease need not run out)
Slurm says its job or step ended (SIGKILLed      out at the next Slurm probe (every 2 s; its lease need
server, scancel, node lost: job failed)           not run out; :mod:`trainer_plugins.slurm_probe`); Slurm
                                                  commands absent or not answering: the lease decides
the directory is unreadable (NFS hiccup)          the last good view is kept and no lease runs out while
                                                  nothing can be read (failed requests still take members
                                                  out); reading resumes where it left off
the end sentinel ``DIR/END``                      :attr:`Fleet.ended` is True (:meth:`Fleet.end` writes it)
================================================  =========================================================

Clock skew: a lease is judged by the writer's own renewal counter ``seq`` as this reader sees it move, timed
on this reader's monotonic clock: a member is live while its ``seq`` advanced within the last ``ttl_s``. The
writer's wall-clock ``expires_at`` is never compared with this host's clock, so nodes whose clocks disagree by
minutes judge each other correctly. The one use of wall time is a record seen for the first time: if its
``renewed_at`` is more than ``ttl_s + max_clock_skew_s`` (default 30 s) behind this host's clock it is
treated as stale until its ``seq`` moves (a record left by a server killed long ago is not routed to).

Proof of membership (issue #33). Every job carries the fleet's bearer token to the member it goes to, and the
directory may be writable by other local users, so a record is used only when it proves its writer:

- with a fleet token (the ``token`` argument, else ``DIR/token`` when it is a regular file of this user with mode
  0600, else ``$PRORL_TOKEN``): its ``sig`` must be the HMAC-SHA256 of the record with that token
  (:func:`prorl_server.membership.verify_record`); whoever wrote the file, a valid signature proves a server that
  holds the token wrote the content, its ``url`` included;
- with no token: only files of this process's uid, opened without following links (``O_NOFOLLOW``, non-blocking,
  owner read with ``fstat`` on the open file), in a ``members/`` directory that this uid owns and that no group
  or other user can write; anything else in it, or the whole directory when it fails that check, is skipped.

A ``DIR/token`` that is not this user's, or that others can read, is not used (logged). When the token changes
(``DIR/token`` appears), every record is checked again.
"""
from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import errno
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import psutil

from prorl_server.membership import (END_SENTINEL, MEMBERS, TOKEN_FILE, MemberRecord, UnverifiedRecordError,
                                     node_name, read_small_file, read_token_file, secure_fleet_dir, verify_record,
                                     write_end)
from trainer_plugins.slurm_probe import SlurmProbe

log = logging.getLogger(__name__)


@dataclass
class _Member:
    """What this reader knows of one record file."""

    record: MemberRecord
    file_id: tuple[int, int, int]  # (inode, mtime_ns, size) of the file last parsed
    seen_at: float  # reader's monotonic time when ``record.seq`` last advanced (or first sight, if fresh)
    gone: bool = False  # same node and its pid is gone
    slurm_gone: bool = False  # Slurm says its job or step ended


class Fleet(collections.abc.Sequence):
    """The routable members of a fleet directory, as a live sequence of URLs (same node first).

    Args:
        fleet_dir: the directory servers were started with (``--fleet-dir``).
        poll_s: seconds between re-reads. max_clock_skew_s: see the module docstring.
        probe_interval_s / probe_timeout_s: how often, and how patiently, a member a request found dead is
            probed (``GET /health``) before it may come back (seconds).
        liveness_interval_s / liveness_timeout_s / liveness_failures: every live member is asked
            ``GET /health`` every ``liveness_interval_s`` (0: never); one that leaves ``liveness_failures``
            probes in a row unanswered for ``liveness_timeout_s`` each is *silent*: out of the rotation, and
            :meth:`is_lost` (its open requests end as resubmittable), until a probe answers. A server that
            renews its lease but accepts connections and never answers would otherwise hold its jobs forever
            (its lease is live, no request is refused or reset).
        local_node: node whose members come first (default: this one).
        start: start the reading thread now (tests read by hand with :meth:`refresh`).
        slurm: a :class:`~trainer_plugins.slurm_probe.SlurmProbe` asked which members' jobs/steps ended
            (``"auto"``: one when the Slurm commands are installed; None: the leases alone decide).
        token: the fleet's bearer token: records must be signed with it, and :attr:`headers` carries it
            (default: ``DIR/token`` if it is this user's and private, else ``$PRORL_TOKEN``, else none: records
            are then trusted by owner; see the module docstring).
    """

    def __init__(self, fleet_dir: str | os.PathLike, *, poll_s: float = 0.25, max_clock_skew_s: float = 30.0,
                 probe_interval_s: float = 1.0, probe_timeout_s: float = 1.0, liveness_interval_s: float = 5.0,
                 liveness_timeout_s: float = 5.0, liveness_failures: int = 3, local_node: Optional[str] = None,
                 start: bool = True, slurm: Union[SlurmProbe, None, str] = "auto",
                 token: Optional[str] = None) -> None:
        self.fleet_dir = Path(fleet_dir)
        self._explicit_token = token or None
        self._key: object = _UNSET  # the token records were last verified with
        self._token_complaint: Optional[str] = None  # the last reason DIR/token was not used (logged once)
        self._dir_complaint: Optional[str] = None  # the last reason members/ was not trusted (logged once)
        self.poll_s = poll_s
        self.max_clock_skew_s = max_clock_skew_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.liveness_interval_s = liveness_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.liveness_failures = liveness_failures
        self._unanswered: dict[str, int] = {}  # member_id -> liveness probes unanswered in a row
        self._silent: set[str] = set()  # member_ids out for silence (liveness_failures unanswered probes)
        self._last_liveness = 0.0
        self.local_node = (local_node or node_name()).split(".", 1)[0]
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}  # file name -> member
        self._suspect: dict[str, float] = {}  # member_id -> monotonic time of its last failed probe/request
        self._draining: set[str] = set()  # member_ids a 503 said are draining
        self._bad_files: dict[str, tuple[int, int, int]] = {}  # files skipped as corrupt (logged once each)
        self._routable: tuple[str, ...] = ()
        self._dir_mtime: Optional[int] = None
        self._last_list = 0.0
        self._blind_since: Optional[float] = None
        self.read_errors = 0
        self.ended = False
        self.slurm: Optional[SlurmProbe] = SlurmProbe.auto() if slurm == "auto" else slurm  # type: ignore[assignment]
        self._last_slurm = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._check_dir()
        self.refresh()
        if start:
            self._thread = threading.Thread(target=self._loop, name=f"fleet-{self.fleet_dir.name}", daemon=True)
            self._thread.start()
            # probes wait on the network (up to probe_timeout_s each): their own thread, so reading never stalls
            threading.Thread(target=self._probe_loop, name=f"fleet-probe-{self.fleet_dir.name}", daemon=True).start()

    def _check_dir(self) -> None:
        """Give a fleet directory of this uid the sticky bit (:func:`prorl_server.membership.secure_fleet_dir`);
        say loudly, once, when one of another user is writable by others without it: its records stay proven by
        their signature, but anyone who can write it could hide the END this trainer writes (the fleet never
        ends) or swap ``members/`` (no member seen). Servers refuse to join such a directory."""
        try:
            if self.fleet_dir.is_dir():
                secure_fleet_dir(self.fleet_dir)
        except OSError as e:
            log.error("fleet: %s", e)

    # ------------------------------------------------------------------ the sequence
    def __len__(self) -> int:
        return len(self._routable)

    def __getitem__(self, i):
        return self._routable[i]

    def __iter__(self):
        return iter(self._routable)

    def __contains__(self, url) -> bool:
        return url in self._routable

    def __repr__(self) -> str:
        return f"Fleet({str(self.fleet_dir)!r}, routable={list(self._routable)})"

    def urls(self) -> list[str]:
        """The URLs that may get new jobs now, same node first, then by member id."""
        return list(self._routable)

    def records(self) -> list[MemberRecord]:
        """Every record read (routable or not), for status displays."""
        with self._lock:
            return [m.record for m in self._members.values()]

    def known_urls(self) -> list[str]:
        """Every member with a live lease that is not draining, suspects included: the fallback when no member
        is routable (a job sent to one fails fast and comes back filtered)."""
        now = time.monotonic()
        with self._lock:
            return [m.record.url for m in self._members.values() if self._live(m, now)
                    and m.record.state == "active" and m.record.member_id not in self._draining]

    @property
    def headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <token>"}`` with the fleet token records are verified with (the
        ``token`` given, ``DIR/token`` written by the launcher, or ``$PRORL_TOKEN``), or ``{}``."""
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def token(self) -> Optional[str]:
        """The fleet token (see :attr:`headers`), read now. Blocking (a small file)."""
        if self._explicit_token:
            return self._explicit_token
        path = self.fleet_dir / TOKEN_FILE
        try:
            token = read_token_file(path, require_owner=True)
            self._token_complaint = None
            return token
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # another user's, readable by others, a FIFO, a link: not our secret
            why = str(e)
            if why != self._token_complaint:
                self._token_complaint = why
                log.warning("fleet: not using %s as the fleet token: %s", path, why)
        return os.environ.get("PRORL_TOKEN") or None

    # ------------------------------------------------------------------ what requests tell us
    def mark_failed(self, url: str, why: str = "") -> None:
        """A request to ``url`` got no answer: out of the rotation at once, until a probe answers."""
        with self._lock:
            ids = [m.record.member_id for m in self._members.values() if m.record.url == url]
            for mid in ids:
                if mid not in self._suspect:
                    log.warning("fleet: %s (%s) failed a request%s: out until it answers a probe", url, mid,
                                f" ({why})" if why else "")
                self._suspect[mid] = time.monotonic()
            self._recompute(time.monotonic())

    def mark_draining(self, url: str) -> None:
        """``url`` answered 503 ``draining``: no new job goes there (its record will say so too)."""
        with self._lock:
            for m in self._members.values():
                if m.record.url == url:
                    self._draining.add(m.record.member_id)
            self._recompute(time.monotonic())

    def is_lost(self, url: str) -> bool:
        """True when ``url``'s member is known dead: its lease ran out (or, on this node, its pid is gone).
        A draining member, a suspect one, or one whose record was removed by a clean exit is not lost."""
        now = time.monotonic()
        with self._lock:
            ms = [m for m in self._members.values() if m.record.url == url]
            return bool(ms) and not any(self._live(m, now) and m.record.member_id not in self._silent for m in ms)

    # ------------------------------------------------------------------ waiting and ending
    async def wait_for_members(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait (asynchronously) until a member is routable; False after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while not self._routable:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def end(self, reason: str = "the trainer ended") -> Path:
        """Write the end sentinel: every member exits, the launcher releases the allocation (within 30 s)."""
        path = write_end(self.fleet_dir, reason, self.token())  # signed: members ignore an END they cannot verify
        self.ended = True
        return path

    def close(self) -> None:
        """Stop the reading thread (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with _FLEETS_LOCK:
            for k in [k for k, f in _FLEETS.items() if f is self]:
                del _FLEETS[k]

    # ------------------------------------------------------------------ reading
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
                self.check_slurm()
            except Exception:  # never let the thread die: the last good view stays
                log.exception("fleet: reading %s failed", self.fleet_dir)

    def check_slurm(self, force: bool = False) -> bool:
        """Ask Slurm (every ``slurm.interval_s``, or now with ``force``) which members' jobs or steps ended, and
        take those out. Blocking (the reading thread calls it). Returns True when the routable set changed."""
        now = time.monotonic()
        if self.slurm is None or (not force and now - self._last_slurm < self.slurm.interval_s):
            return False
        self._last_slurm = now
        with self._lock:
            asked = [(m.record.member_id, m.record.cluster, m.record.job_id, m.record.step_id)
                     for m in self._members.values() if m.record.job_id]
        if not asked:
            return False
        dead = self.slurm.dead(asked)  # subprocesses: outside the lock
        with self._lock:
            for m in self._members.values():
                was, m.slurm_gone = m.slurm_gone, m.record.member_id in dead
                if m.slurm_gone and not was:
                    log.warning("fleet: Slurm says job %s step %s of %s (%s) ended: out", m.record.job_id,
                                m.record.step_id, m.record.member_id, m.record.url)
            return self._recompute(time.monotonic())

    def _probe_loop(self) -> None:
        while not self._stop.wait(min(self.poll_s, self.probe_interval_s)):
            try:
                self._probe_suspects()
                if self.liveness_interval_s > 0 and time.monotonic() - self._last_liveness >= self.liveness_interval_s:
                    self._last_liveness = time.monotonic()
                    self.probe_liveness()
            except Exception:
                log.exception("fleet: probing members of %s failed", self.fleet_dir)

    def refresh(self) -> bool:
        """Re-read the directory (blocking; the thread calls it every ``poll_s``). Returns True when the
        routable set changed."""
        now = time.monotonic()
        key = self.token()
        if key != self._key:
            with self._lock:  # a new token: what was proven with the old one (or by owner) is proven again
                if self._members or self._bad_files:
                    log.info("fleet %s: the fleet token changed: every record is verified again", self.fleet_dir)
                self._members.clear()
                self._bad_files.clear()
                self._dir_mtime = None
                self._key = key
        members = self.fleet_dir / MEMBERS
        try:
            # one descriptor for the checks and every open below: renaming members/ away cannot swap it
            dfd = os.open(members, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if self._blind_since is None and not self._members:  # not created yet: an empty fleet, not an outage
                self.ended = os.path.exists(self.fleet_dir / END_SENTINEL)
                return False
            return self._blind(now, "members/ is missing")
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file put in its place: nothing there is ours
                return self._distrust(now, "members/ is a symlink or not a directory")
            return self._blind(now, repr(e))
        try:
            st = os.fstat(dfd)
            if key is None:
                problem = _not_private(st)
                if problem:
                    return self._distrust(now, f"{members} {problem}, and no fleet token is configured")
            self._dir_complaint = None
            listing = None
            if st.st_mtime_ns != self._dir_mtime or now - self._last_list >= 1.0:
                listing = [e for e in os.scandir(dfd) if e.name.endswith(".json") and not e.name.startswith(".")]
                stats = {e.name: e.stat(follow_symlinks=False) for e in listing}
            self.ended = os.path.exists(self.fleet_dir / END_SENTINEL)
            if listing is None:  # nothing was added, replaced or removed
                with self._lock:
                    self._end_blindness(now)
                    return self._recompute(now)
            self._dir_mtime, self._last_list = st.st_mtime_ns, now
            parsed = self._parse(members, dfd, stats, key)
        except OSError as e:
            return self._blind(now, repr(e))
        finally:
            os.close(dfd)
        wall = time.time()
        with self._lock:
            self._end_blindness(now)
            for name in list(self._members):
                if name not in stats:
                    del self._members[name]  # removed: a clean exit
            for name, (rec, file_id) in parsed.items():
                known = self._members.get(name)
                if known is None:
                    fresh = wall - rec.renewed_at <= rec.ttl_s + self.max_clock_skew_s
                    seen_at = now if fresh else now - rec.ttl_s - 1.0
                    self._members[name] = _Member(rec, file_id, seen_at)
                else:
                    if rec.seq != known.record.seq:
                        known.seen_at = now
                    known.record, known.file_id = rec, file_id
            for m in self._members.values():
                m.gone = m.record.node == self.local_node and not psutil.pid_exists(m.record.pid)
            live_ids = {m.record.member_id for m in self._members.values()}
            for mid in [mid for mid in self._suspect if mid not in live_ids]:
                del self._suspect[mid]
            self._draining &= live_ids
            return self._recompute(now)

    def _parse(self, members: Path, dfd: int, stats: dict[str, os.stat_result],
               key: Optional[str]) -> dict[str, tuple[MemberRecord, tuple[int, int, int]]]:
        """Read and verify the records that changed since the last read (``key``: the fleet token, or None to
        trust by owner). Unproven and corrupt files are skipped with one log line per file version."""
        parsed: dict[str, tuple[MemberRecord, tuple[int, int, int]]] = {}
        owner = None if key else os.geteuid()
        for name, s in stats.items():
            file_id = (s.st_ino, s.st_mtime_ns, s.st_size)
            known = self._members.get(name)
            if known is not None and known.file_id == file_id:
                continue
            if self._bad_files.get(name) == file_id:
                continue
            try:
                rec = verify_record(read_small_file(name, dir_fd=dfd, owner=owner), key)
                if f"{rec.member_id}.json" != name:
                    raise UnverifiedRecordError(f"it names member {rec.member_id[:80]!r}, not its file")
            except FileNotFoundError:  # replaced or removed since the listing: the next poll sees it
                continue
            except UnverifiedRecordError as e:
                self._bad_files[name] = file_id
                log.warning("fleet: skipping %s: not a proven member (%s): no job and no token go to it",
                            members / name, e)
                continue
            except (OSError, ValueError) as e:
                self._bad_files[name] = file_id
                log.warning("fleet: skipping %s: not a member record (%s)", members / name,
                            str(e).splitlines()[0][:200])
                continue
            self._bad_files.pop(name, None)
            parsed[name] = (rec, file_id)
        return parsed

    def _distrust(self, now: float, why: str) -> bool:
        """No record of the directory can be trusted: every member is dropped (logged once per reason)."""
        if why != self._dir_complaint:
            self._dir_complaint = why
            log.warning("fleet: trusting no record in %s: %s (give the fleet a token: DIR/token, mode 600, or "
                        "PRORL_TOKEN; or keep members/ yours and writable by you alone)", self.fleet_dir, why)
        self._dir_mtime = None
        self.ended = os.path.exists(self.fleet_dir / END_SENTINEL)
        with self._lock:
            self._end_blindness(now)
            self._members.clear()
            return self._recompute(now)

    def _blind(self, now: float, why: str) -> bool:
        self.read_errors += 1
        if self._blind_since is None:
            self._blind_since = now
            log.warning("fleet: cannot read %s (%s): keeping the last view of %d member(s)", self.fleet_dir, why,
                        len(self._members))
        return False

    def _end_blindness(self, now: float) -> None:
        """Called with the lock held after a good read: time spent unable to read does not count against any
        lease (renewals could not be seen)."""
        if self._blind_since is not None:
            blind = now - self._blind_since
            for m in self._members.values():
                m.seen_at += blind
            log.info("fleet: %s readable again after %.1f s", self.fleet_dir, blind)
            self._blind_since = None

    def _live(self, m: _Member, now: float) -> bool:
        if m.gone or m.slurm_gone:
            return False
        if self._blind_since is not None:  # nothing can be seen: the lease as it was when reading stopped
            now = self._blind_since
        return now - m.seen_at <= m.record.ttl_s

    def _recompute(self, now: float) -> bool:
        """Rebuild the routable tuple (lock held). True when it changed."""
        ok = [m.record for m in self._members.values()
              if m.record.state == "active" and self._live(m, now) and m.record.member_id not in self._suspect
              and m.record.member_id not in self._draining and m.record.member_id not in self._silent]
        ok.sort(key=lambda r: (r.node.split(".", 1)[0] != self.local_node, r.member_id))
        routable = tuple(r.url for r in ok)
        changed = routable != self._routable
        if changed:
            added = set(routable) - set(self._routable)
            removed = set(self._routable) - set(routable)
            log.info("fleet %s: %d routable%s%s", self.fleet_dir, len(routable),
                     f"; joined {sorted(added)}" if added else "", f"; left {sorted(removed)}" if removed else "")
        self._routable = routable
        return changed

    def _probe_suspects(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(mid, m.record.url) for m in self._members.values()
                   if (mid := m.record.member_id) in self._suspect and self._live(m, now)
                   and now - self._suspect[mid] >= self.probe_interval_s]
        for mid, url in due:
            ok = _healthy(url, self.probe_timeout_s)
            with self._lock:
                if ok:
                    self._suspect.pop(mid, None)
                    log.info("fleet: %s answered its probe: back in the rotation", url)
                else:
                    self._suspect[mid] = time.monotonic()
                self._recompute(time.monotonic())

    def probe_liveness(self) -> None:
        """Ask every live member ``GET /health`` at once (blocking, up to ``liveness_timeout_s``); count the
        unanswered ones, take out those silent ``liveness_failures`` times in a row, bring back any that
        answers (the probe thread calls it every ``liveness_interval_s``)."""
        now = time.monotonic()
        with self._lock:
            due = {m.record.member_id: m.record.url for m in self._members.values() if self._live(m, now)}
        if not due:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(due))) as pool:
            answered = dict(zip(due, pool.map(lambda u: _healthy(u, self.liveness_timeout_s), due.values())))
        with self._lock:
            for mid, ok in answered.items():
                if ok:
                    self._unanswered.pop(mid, None)
                    if mid in self._silent:
                        self._silent.discard(mid)
                        log.info("fleet: %s answered again: back in the rotation", due[mid])
                    continue
                self._unanswered[mid] = self._unanswered.get(mid, 0) + 1
                if self._unanswered[mid] >= self.liveness_failures and mid not in self._silent:
                    self._silent.add(mid)
                    log.warning("fleet: %s (%s) renews its lease but left %d health probes unanswered: out, and "
                                "its open requests end as resubmittable", due[mid], mid, self._unanswered[mid])
            for mid in list(self._unanswered):  # members that left
                if mid not in due:
                    self._unanswered.pop(mid, None)
                    self._silent.discard(mid)
            self._recompute(time.monotonic())


_UNSET = object()


def _not_private(st: os.stat_result) -> Optional[str]:
    """Why a directory with status ``st`` could hold records this uid did not write, or None: it must be this
    process's own and writable by no group or other user."""
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"has mode {st.st_mode & 0o777:04o}: other users can write it"
    return None


def _healthy(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


_FLEETS: dict[str, Fleet] = {}
_FLEETS_LOCK = threading.Lock()


def open_fleet(fleet_dir: str | os.PathLike, **kwargs) -> Fleet:
    """The process's one :class:`Fleet` of ``fleet_dir`` (one reading thread however many clients follow it:
    verl builds a submitter per event loop); one per fleet token when ``token=`` is given."""
    key = f"{Path(fleet_dir).resolve()}\0{hash(kwargs.get('token') or '')}"
    with _FLEETS_LOCK:
        fleet = _FLEETS.get(key)
        if fleet is None or fleet._stop.is_set():
            fleet = _FLEETS[key] = Fleet(fleet_dir, **kwargs)
        return fleet


def is_fleet_dir(path: str | os.PathLike) -> bool:
    """A directory that is a fleet directory: it has ``members/``, or it is a directory with no
    ``servers.json`` (a fleet no server has joined yet)."""
    p = Path(path)
    return p.is_dir() and ((p / MEMBERS).is_dir() or not (p / "servers.json").exists())
