"""Lease directories are shared node state that another local user can write (issue #33, part 6): a name
planted there (a FIFO, a symbolic link, a directory, another user's file) is skipped, never a failed or hung
sandbox start; a root server leases sandbox uids from a directory only it can write; what fails on the host
while a sandbox is prepared is a typed start error. Unit tests of :mod:`sandbox.leases` (fast tier) and real
bubblewrap starts (real tier)."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from sandbox.errors import SandboxStartError
from sandbox.leases import ensure_lease_dir, try_lease

OTHER_UID = 1_234_567  # a uid nobody on this node has: "another local user"


def _plant(lease_dir: str, name: str, kind: str) -> None:
    """Put what a co-tenant could put at ``lease_dir/name``: ``fifo``, ``link`` (to a file of ours),
    ``dir``, ``foreign`` (a regular file owned by another uid; needs root to make here), ``hardlink`` (a
    second link to a regular file of ours)."""
    path = os.path.join(lease_dir, name)
    if kind == "fifo":
        os.mkfifo(path, 0o666)
    elif kind == "link":
        os.symlink(os.path.join(lease_dir, "..", "victim"), path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "foreign":
        with open(path, "w") as f:
            f.write("theirs")
        os.chown(path, OTHER_UID, OTHER_UID)
    elif kind == "hardlink":
        os.link(os.path.join(lease_dir, "..", "victim"), path)
    else:
        raise ValueError(kind)


def _in_thread(fn, timeout_s: float = 10.0):
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it does not return in time."""
    out: dict = {}

    def run() -> None:
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread below
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} blocked for {timeout_s} s"
    if "e" in out:
        raise out["e"]
    return out["r"]


KINDS = ["fifo", "link", "dir", "hardlink"] + (["foreign"] if os.geteuid() == 0 else [])


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_name_is_skipped_without_blocking_or_raising(tmp_path, kind):
    lease_dir = str(tmp_path / "leases")
    ensure_lease_dir(lease_dir)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    _plant(lease_dir, "7", kind)
    assert _in_thread(lambda: try_lease(lease_dir, "7", owner="sb-x")) is None
    assert victim.read_text() == "precious"  # never truncated through a link
    lease = try_lease(lease_dir, "8", owner="sb-x")  # the next name is fine
    assert lease is not None and lease.held
    lease.release()
    assert not os.path.exists(os.path.join(lease_dir, "8"))


def test_a_lease_file_of_ours_left_by_a_crash_is_reused_and_a_held_one_is_not(tmp_path):
    lease_dir = str(tmp_path / "leases")
    ensure_lease_dir(lease_dir)
    (tmp_path / "leases" / "5").write_text("{}")  # left by a holder that died (no lock on it)
    first = try_lease(lease_dir, "5")
    assert first is not None
    assert try_lease(lease_dir, "5") is None  # held (flock) by `first`
    first.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="a private uid lease directory is a root server's")
def test_private_lease_dir_is_made_unwritable_by_others_and_another_users_one_is_refused(tmp_path):
    mine = str(tmp_path / "uids")
    ensure_lease_dir(mine, private=True)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755
    os.chmod(mine, 0o1777)  # as the old code made it
    ensure_lease_dir(mine, private=True)
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(SandboxStartError, match="belongs to uid"):
        ensure_lease_dir(str(theirs), private=True)
    os.symlink(mine, tmp_path / "link")
    with pytest.raises(SandboxStartError, match="not a directory"):
        ensure_lease_dir(str(tmp_path / "link"), private=True)


def test_a_root_servers_default_uid_lease_dir_is_one_only_root_can_write():
    from sandbox.bubblewrap import DEFAULT_UID_LEASE_DIR

    parent = os.path.dirname(DEFAULT_UID_LEASE_DIR)
    st = os.stat(parent)
    # Nobody but root can create the directory itself (or anything in its parent) before a root server does.
    assert st.st_uid == 0 and not st.st_mode & 0o022, (parent, oct(st.st_mode))


@pytest.mark.real
@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are leased only by a server running as root")
async def test_root_sandbox_starts_when_a_co_tenant_planted_every_other_free_uid(runtime_options, short_tmp):
    """Every name but one of a small uid range holds something planted (FIFO, link, directory, another uid's
    file, a hard link): the sandbox starts on the one good uid; with none left, the start fails promptly with
    a typed start error (infrastructure), never a hang."""
    import asyncio

    from sandbox import make_runtime

    uid_dir = os.path.join(short_tmp, "uids")
    first, kinds = 3_800_000_000, ["fifo", "link", "dir", "foreign", "hardlink"]
    ensure_lease_dir(uid_dir, private=True)
    with open(os.path.join(short_tmp, "victim"), "w") as f:
        f.write("precious")
    for i, kind in enumerate(kinds):
        _plant(uid_dir, str(first + i), kind)
    rt = make_runtime("bubblewrap", uid_lease_dir=uid_dir, uid_range=(first, len(kinds) + 1), **runtime_options)
    try:
        h = await asyncio.wait_for(rt.start(), 30)
        r = await h.bash("id -u", timeout_s=20)
        assert r.output.split() == [str(first + len(kinds))], r.output
        with pytest.raises(SandboxStartError, match="no free sandbox uid"):
            await asyncio.wait_for(rt.start(), 30)  # the one good uid is held by `h`
        await h.close()
    finally:
        await rt.close_all()
    with open(os.path.join(short_tmp, "victim")) as f:
        assert f.read() == "precious"


@pytest.mark.real
async def test_loopback_sandbox_starts_when_a_co_tenant_planted_fifos_in_the_shared_address_dir(runtime_options):
    """The loopback addresses' directory is shared by every user (1777): FIFOs and links at all but one address
    of a small pool; the sandbox gets the one left, and with none left the start fails promptly and typed."""
    import asyncio

    from sandbox import SandboxSpec, make_runtime

    lease_dir = runtime_options["loopback_dir"]
    ensure_lease_dir(lease_dir)
    pool = [f"127.200.0.{i}" for i in range(1, 7)]  # 127.200.0.0/29 without its first and last address
    for i, addr in enumerate(pool[:-1]):
        if i % 2:
            os.symlink("/etc/hostname", os.path.join(lease_dir, addr))
        else:
            os.mkfifo(os.path.join(lease_dir, addr), 0o666)
    rt = make_runtime("bubblewrap", loopback_network="127.200.0.0/29", **runtime_options)
    try:
        h = await asyncio.wait_for(rt.start(SandboxSpec(network="loopback")), 30)
        assert h.address == pool[-1]
        with pytest.raises(SandboxStartError, match="no free loopback address"):
            await asyncio.wait_for(rt.start(SandboxSpec(network="loopback")), 30)
        await h.close()
    finally:
        await rt.close_all()


async def test_an_os_error_while_preparing_a_sandbox_is_a_typed_start_error(runtime_options, short_tmp):
    """What fails on the host while a sandbox is prepared (here its workspace cannot be created; a full disk,
    a refused cgroup, an unusable lease directory alike) is a SandboxStartError with the OSError as its cause:
    the host's doing, never the sandbox's. Nothing is launched."""
    from sandbox import make_runtime

    blocker = os.path.join(short_tmp, "not-a-dir")
    with open(blocker, "w") as f:
        f.write("x")
    rt = make_runtime("bubblewrap", **{**runtime_options, "workspace_root": os.path.join(blocker, "ws")})
    with pytest.raises(SandboxStartError, match="could not be prepared") as e:
        await rt.start()
    assert isinstance(e.value.__cause__, OSError)
    assert rt.handles == [] and rt.store.records() == []
    await rt.close_all()
