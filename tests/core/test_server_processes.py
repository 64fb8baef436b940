"""Issue #26 with real processes: ``prorl-server --processes 2`` runs two independent members under one
supervisor (signals forwarded, a dead member stops the rest), the listen backlog reaches the kernel, and the
sandbox runtime's node-wide leases (loopback addresses, sandbox uids) never give one name to two server
processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / "ready.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PRORL_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--sandbox-runtime", "none", "--log-level", "WARNING", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(600):  # hang guard: 60 s
        if ready.exists():
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the server did not start: {proc.communicate()[0].decode()[-2000:]}")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str) -> dict:
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int]) -> list[int]:
    for _ in range(300):  # hang guard: 30 s
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port``: ``ss`` shows it as Send-Q of a LISTEN socket."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


def test_two_members_are_independent_servers_under_one_supervisor(tmp_path):
    proc, ready = _start(tmp_path, "--processes", "2")
    try:
        members = ready["members"]
        assert len(members) == 2 and ready["url"] == members[0]["url"] and ready["pid"] == proc.pid
        assert len({m["port"] for m in members}) == 2 and len({m["pid"] for m in members}) == 2
        assert all(_get(m["url"] + "/health") == {"status": "ok"} for m in members)
        # each member is a server of its own: stopping one leaves the other accepting jobs
        _post(members[0]["url"] + "/stop")
        assert _get(members[0]["url"] + "/status")["accepting"] is False
        assert _get(members[1]["url"] + "/status")["accepting"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert _wait_gone([m["pid"] for m in members]) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_member_that_dies_takes_the_others_and_the_supervisor_down(tmp_path):
    proc, ready = _start(tmp_path, "--processes", "2")
    try:
        first, second = ready["members"]
        os.kill(second["pid"], signal.SIGKILL)
        assert proc.wait(60) == 1  # the launcher sees the step end and stops the job
        assert _wait_gone([first["pid"]]) == []
        assert b"exited" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_listen_backlog_reaches_the_kernel(tmp_path):
    # aiohttp's default was 128: the kernel dropped connections when thousands of clients connected at once
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    for flags, want in (((), min(4096, somaxconn)), (("--listen-backlog", "1000"), min(1000, somaxconn))):
        proc, ready = _start(tmp_path, *flags)
        try:
            assert _listen_backlog(ready["port"]) == want
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        (tmp_path / "ready.json").unlink()


LEASER = textwrap.dedent("""
    import json, os, sys
    from sandbox.loopback import LoopbackAllocator
    from sandbox.bubblewrap import BubblewrapRuntime
    from sandbox import SandboxSpec

    addr_dir, uid_dir, n_addr, n_uid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    alloc = LoopbackAllocator(lease_dir=addr_dir, network="127.200.0.0/26")
    held = [alloc.allocate(owner=f"p{os.getpid()}") for _ in range(n_addr)]
    uids = []
    if n_uid:
        rt = BubblewrapRuntime(uid_lease_dir=uid_dir, uid_range=(3_900_000_000, 2 * n_uid))
        for i in range(n_uid):
            user, lease = rt.sandbox_user(SandboxSpec(), f"sb{os.getpid()}-{i}")
            uids.append(user[0])
            held.append(lease)
    print(json.dumps({"addresses": [h.address for h in held[:n_addr]], "uids": uids}), flush=True)
    sys.stdin.readline()  # hold the leases until the test says so
""")


def test_two_server_processes_never_hold_the_same_loopback_address_or_sandbox_uid(tmp_path):
    # Two processes of one node lease from the same small pools at once (62 usable addresses: 25 each; 40
    # uids: 20 each, all of them); what each holds must be disjoint, and free again once it exits.
    addr_dir, uid_dir = tmp_path / "addr", tmp_path / "uid"
    n_uid = 20 if os.geteuid() == 0 else 0  # sandbox uids are leased only by a server running as root
    script = tmp_path / "leaser.py"
    script.write_text(LEASER)

    def leaser(n_addr: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(addr_dir), str(uid_dir), str(n_addr), str(n_uid)],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    a, b = leaser(25), leaser(25)
    try:
        held = [json.loads(p.stdout.readline()) for p in (a, b)]
        assert len(set(held[0]["addresses"]) | set(held[1]["addresses"])) == 50
        assert not set(held[0]["uids"]) & set(held[1]["uids"])
        if n_uid:
            assert sorted(held[0]["uids"] + held[1]["uids"]) == list(range(3_900_000_000, 3_900_000_040))
    finally:
        for p in (a, b):
            p.stdin.close()
            p.wait(30)
    c = leaser(50)  # the leases ended with their processes: the whole pool is free again
    try:
        again = json.loads(c.stdout.readline())
        assert len(set(again["addresses"])) == 50 and len(again["uids"]) == n_uid
    finally:
        c.stdin.close()
        c.wait(30)


HOLDER = textwrap.dedent("""
    import asyncio, json, sys
    from sandbox import SandboxSpec, make_runtime

    async def main():
        rt = make_runtime("bubblewrap", state_dir=sys.argv[1])
        if sys.argv[2] == "hold":
            sb = await rt.start(SandboxSpec())
            print(json.dumps({"pid": sb.pid, "out": (await sb.bash("echo alive")).output.strip()}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            print(json.dumps({"out": (await sb.bash("echo still")).output.strip()}), flush=True)
            await rt.close_all()
        else:
            print(json.dumps({"reaped": await rt.reap_orphans()}), flush=True)

    asyncio.run(main())
""")


def test_a_second_member_starting_on_the_node_leaves_the_first_members_sandboxes_alone(tmp_path):
    # Members share the per-user sandbox records; a starting server reaps the sandboxes of servers that are gone,
    # and must not take a live member's sandbox for an orphan.
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    state = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, str(script), str(state), "hold"], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(holder.stdout.readline())
        assert first["out"] == "alive"
        other = subprocess.run([sys.executable, str(script), str(state), "reap"], cwd=ROOT, capture_output=True,
                               text=True, timeout=120)
        assert json.loads(other.stdout.splitlines()[-1]) == {"reaped": 0}, other.stderr[-2000:]
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == {"out": "still"}
    finally:
        holder.stdin.close()
        holder.wait(60)
