"""``servers.json``: where the rollout servers of a Slurm job are, and how a trainer finds them.

``slurm/launch_rollout.sh`` writes the file (through ``python -m trainer_plugins.servers compose``) once every
server of the job answers ``GET /health``, and removes it when the job stops. A trainer reads it with
:func:`load_servers` (or :func:`wait_for_servers` while the job is starting) and talks to the servers in
:meth:`ServersFile.ordered` order: servers on the trainer's own node first.

Format, version 1 (JSON object; the file is created with mode 0600 because it holds the bearer token)::

    {
      "version": 1,
      "job_id": "1234",                  # Slurm job id, a string
      "token": "9f8e...",                # bearer token shared by every server of the job
      "created_at": 1763700000.0,        # unix time, seconds
      "servers": [
        {"url": "http://10.1.2.3:40123", # base URL a trainer uses
         "node": "gpu-a01",              # Slurm node name (short)
         "host": "10.1.2.3", "port": 40123, "pid": 4711,
         "llm_backends": ["http://10.1.2.3:8000"]}   # vLLM servers registered with this server
      ]
    }

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a reader never sees a
half-written file. Everything here is blocking and small: call it from a thread in async code.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from trainer_plugins.fleet import Fleet, is_fleet_dir

FORMAT_VERSION = 1
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class ServersFileError(ValueError):
    """servers.json is missing a field, has a wrong type, or is not JSON. The message names the problem."""


@dataclass(frozen=True)
class ServerEntry:
    """One rollout server. ``url`` is its base URL (``http://host:port``, no trailing slash)."""

    url: str
    node: str
    host: str
    port: int
    pid: Optional[int] = None
    llm_backends: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServersFile:
    """The parsed ``servers.json`` of one job."""

    job_id: str
    token: Optional[str]
    servers: tuple[ServerEntry, ...]
    created_at: float = 0.0
    path: Optional[Path] = field(default=None, compare=False)

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for every non-health request: ``{"Authorization": "Bearer <token>"}`` (or ``{}``)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def ordered(self, local_node: Optional[str] = None) -> list[ServerEntry]:
        """Servers with those on ``local_node`` (default: this node, see :func:`local_node_name`) first."""
        return order_servers(self.servers, local_node_name() if local_node is None else local_node)

    def urls(self, local_node: Optional[str] = None) -> list[str]:
        """Base URLs in :meth:`ordered` order."""
        return [s.url for s in self.ordered(local_node)]


def short_name(name: str) -> str:
    """``gpu-a01.cluster.example`` -> ``gpu-a01`` (Slurm node names are short host names)."""
    return name.split(".", 1)[0]


def local_node_name() -> str:
    """This process's node: ``$SLURMD_NODENAME`` inside a Slurm job, else the short host name."""
    return short_name(os.environ.get("SLURMD_NODENAME") or socket.gethostname())


def order_servers(servers: Iterable[ServerEntry], local_node: str) -> list[ServerEntry]:
    """Same-node servers first (short names compared), then the others; file order is kept within each group.

    Same-node first because a trainer worker on a node that also runs a rollout server saves a network hop
    per request and keeps working if the interconnect to other nodes is congested.
    """
    local = short_name(local_node)
    servers = list(servers)
    return [s for s in servers if short_name(s.node) == local] + [s for s in servers if short_name(s.node) != local]


def server_for_group(urls: Sequence[str], group_id: str) -> str:
    """The rollout server for every sample of the group ``group_id``, chosen by rendezvous hashing (Thaler and
    Ravishankar 1998, "highest random weight"): the URL with the largest ``blake2b(group_id, url)``.

    For trainers whose samples of one group are submitted by different processes that share no state (verl's
    agent loop workers): each process computes the same server, groups spread evenly over the servers, and
    removing a server moves only its own groups. A client that submits whole groups itself should prefer
    least-in-flight (``RolloutClient`` does). Raises ValueError for an empty ``urls``.
    """
    if not urls:
        raise ValueError("no rollout server to choose from")

    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{group_id}\0{url}".encode(), digest_size=8).digest()

    return max(urls, key=weight)


def _require(obj: dict, key: str, kind: type | tuple[type, ...], where: str):
    if key not in obj:
        raise ServersFileError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ServersFileError(f"{where}: field {key!r} has type {type(value).__name__}")
    return value


def parse_servers(data: dict, path: Optional[Path] = None) -> ServersFile:
    """Validate a decoded servers.json object. Raises :class:`ServersFileError` naming the bad field."""
    where = str(path) if path else "servers.json"
    if not isinstance(data, dict):
        raise ServersFileError(f"{where}: top level is {type(data).__name__}, expected an object")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ServersFileError(f"{where}: format version {version!r}, this reader knows {FORMAT_VERSION}")
    job_id = str(_require(data, "job_id", (str, int), where))
    token = data.get("token")
    if token is not None and not isinstance(token, str):
        raise ServersFileError(f"{where}: field 'token' has type {type(token).__name__}")
    raw = _require(data, "servers", list, where)
    servers = []
    for i, s in enumerate(raw):
        w = f"{where}: servers[{i}]"
        if not isinstance(s, dict):
            raise ServersFileError(f"{w} is {type(s).__name__}, expected an object")
        backends = s.get("llm_backends", [])
        if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
            raise ServersFileError(f"{w}: field 'llm_backends' must be a list of URLs")
        servers.append(ServerEntry(
            url=_require(s, "url", str, w).rstrip("/"),
            node=_require(s, "node", str, w),
            host=_require(s, "host", str, w),
            port=_require(s, "port", int, w),
            pid=s.get("pid"),
            llm_backends=tuple(backends),
        ))
    return ServersFile(job_id=job_id, token=token, servers=tuple(servers),
                       created_at=float(data.get("created_at", 0.0)), path=path)


def load_servers(path: str | os.PathLike) -> ServersFile:
    """Read ``servers.json`` (a file, or a directory holding one).

    Raises ``FileNotFoundError`` when it does not exist (the job has not started, or has stopped) and
    :class:`ServersFileError` when it is malformed.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "servers.json"
    text = p.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServersFileError(f"{p}: not JSON ({e})") from None
    return parse_servers(data, p)


def wait_for_servers(path: str | os.PathLike, timeout_s: float = 600.0, poll_s: float = 0.5,
                     job_id: Optional[str] = None) -> ServersFile:
    """Wait until ``servers.json`` exists (and, with ``job_id``, belongs to that job); return it parsed.

    ``timeout_s`` and ``poll_s`` are seconds. Raises ``TimeoutError`` naming the path when it does not appear.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sf = load_servers(path)
            if job_id is None or sf.job_id == str(job_id):
                return sf
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no servers.json{' of job ' + str(job_id) if job_id else ''} at {path} "
                               f"after {timeout_s:g} s")
        time.sleep(poll_s)


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET {url}/health`` answers 200 within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_healthy(urls: Sequence[str], timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
    """Wait until every URL answers ``/health``. Raises ``TimeoutError`` listing those that never did."""
    pending = list(urls)
    deadline = time.monotonic() + timeout_s
    while pending:
        pending = [u for u in pending if not is_healthy(u)]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not healthy after {timeout_s:g} s: {', '.join(pending)}")
        time.sleep(poll_s)


def write_servers(path: str | os.PathLike, job_id: str, token: Optional[str],
                  servers: Sequence[ServerEntry]) -> Path:
    """Write servers.json atomically with mode 0600 (it holds the token). Returns the path written."""
    p = Path(path)
    if p.is_dir():
        p = p / "servers.json"
    data = {
        "version": FORMAT_VERSION,
        "job_id": str(job_id),
        "token": token,
        "created_at": time.time(),
        "servers": [
            {"url": s.url, "node": s.node, "host": s.host, "port": s.port, "pid": s.pid,
             "llm_backends": list(s.llm_backends)}
            for s in servers
        ],
    }
    fd, tmp = tempfile.mkstemp(prefix=".servers.", suffix=".json.tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp already made it 0600
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def remove_servers(path: str | os.PathLike, job_id: str) -> bool:
    """Remove servers.json if it belongs to ``job_id`` (another job may have replaced it). True if removed."""
    p = Path(path)
    if p.is_dir():
        p = p / "servers.json"
    try:
        if load_servers(p).job_id != str(job_id):
            return False
    except FileNotFoundError:
        return False
    except ServersFileError:
        return False
    p.unlink(missing_ok=True)
    return True


def entry_from_ready_file(ready_file: Path, node: str, advertise_host: Optional[str] = None,
                          llm_backends: Sequence[str] = ()) -> ServerEntry:
    """Build an entry from the JSON ``prorl-server --ready-file`` writes (``{host, port, pid, url}``).

    A server bound to a wildcard address (0.0.0.0) is advertised at ``advertise_host`` (the node's address
    as the launcher resolved it); otherwise at the address it bound. Raises :class:`ServersFileError` when
    the ready file is malformed or a wildcard bind has no advertised host.
    """
    try:
        ready = json.loads(Path(ready_file).read_text())
    except json.JSONDecodeError as e:
        raise ServersFileError(f"{ready_file}: not JSON ({e})") from None
    bound = _require(ready, "host", str, str(ready_file))
    port = _require(ready, "port", int, str(ready_file))
    host = advertise_host if bound in WILDCARD_HOSTS else bound
    if not host:
        raise ServersFileError(f"{ready_file}: server bound {bound!r} and no advertised host was given")
    url_host = f"[{host}]" if ":" in host else host
    return ServerEntry(url=f"http://{url_host}:{port}", node=short_name(node), host=host, port=port,
                       pid=ready.get("pid"), llm_backends=tuple(llm_backends))


# ------------------------------------------------------------------------------------------------ CLI


def _compose(args: argparse.Namespace) -> int:
    """Used by launch_rollout.sh: ``<run_dir>/<node>.ready.json`` (+ ``.advertise``, ``.llm``) -> servers.json."""
    run_dir = Path(args.run_dir)
    entries = []
    for node in args.nodes.split(","):
        adv_file = run_dir / f"{node}.advertise"
        llm_file = run_dir / f"{node}.llm"
        adv = adv_file.read_text().strip() if adv_file.exists() else None
        llm = [ln.strip() for ln in llm_file.read_text().splitlines() if ln.strip()] if llm_file.exists() else []
        entries.append(entry_from_ready_file(run_dir / f"{node}.ready.json", node, adv, llm))
    token = os.environ.get(args.token_env) or None
    if not args.no_health_check:
        wait_healthy([e.url for e in entries], timeout_s=args.timeout)
    out = write_servers(args.out, args.job_id, token, entries)
    print(out)
    return 0


def _show(args: argparse.Namespace) -> int:
    if is_fleet_dir(args.path):  # a fleet directory goes wherever a servers.json does: its live members
        return _show_fleet(args)
    sf = wait_for_servers(args.path, args.wait) if args.wait else load_servers(args.path)
    for s in sf.ordered(args.node):
        health = ("ok" if is_healthy(s.url) else "DOWN") if args.health else ""
        print(f"{s.url}\t{s.node}\t{health}".rstrip())
    return 0


def _show_fleet(args: argparse.Namespace) -> int:
    fleet = Fleet(args.path, local_node=args.node, start=False, slurm=None)  # one reading, no threads
    deadline = time.monotonic() + args.wait
    while not fleet.urls() and time.monotonic() < deadline:
        time.sleep(0.25)
        fleet.refresh()
    if not fleet.urls():
        raise TimeoutError(f"no live member in the fleet {args.path}"
                           + (f" after {args.wait:g} s" if args.wait else " (--wait S waits for one)"))
    nodes = {r.url: r.node for r in fleet.records()}
    for url in fleet.urls():
        health = ("ok" if is_healthy(url) else "DOWN") if args.health else ""
        print(f"{url}\t{nodes.get(url, '')}\t{health}".rstrip())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m trainer_plugins.servers {show,compose,remove}``; exit 1 with a message on an error."""
    p = argparse.ArgumentParser(prog="python -m trainer_plugins.servers",
                                description="Read or write the servers.json of a rollout job.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="print the servers, same-node first: URL, node[, health]")
    s.add_argument("path", help="servers.json, the directory holding it, or a fleet directory")
    s.add_argument("--node", help="order for this node (default: this one)")
    s.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the file")
    s.add_argument("--health", action="store_true", help="also probe GET /health of each")
    c = sub.add_parser("compose", help="(launcher) write servers.json from the servers' ready files")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--nodes", required=True, help="comma-separated node names")
    c.add_argument("--job-id", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--token-env", default="PRORL_TOKEN", help="environment variable holding the token")
    c.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health of all")
    c.add_argument("--no-health-check", action="store_true")
    r = sub.add_parser("remove", help="(launcher) remove servers.json if it belongs to the job")
    r.add_argument("path")
    r.add_argument("--job-id", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "show":
            return _show(args)
        if args.cmd == "compose":
            return _compose(args)
        removed = remove_servers(args.path, args.job_id)
        print("removed" if removed else "kept (absent or another job's)")
        return 0
    except (OSError, ServersFileError, TimeoutError) as e:
        print(f"servers: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
