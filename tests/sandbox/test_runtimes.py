"""Runtime selection, the bubblewrap command line, the local runtime, and the loopback allocator."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os

import pytest

from sandbox import LoopbackAllocator, SandboxError, SandboxSpec, make_runtime
from sandbox.bubblewrap import build_bwrap_command
from sandbox.runtime import SERVER_ENTRY, LaunchContext


def test_unknown_runtime_kind_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown sandbox runtime 'docker'; choose bubblewrap, singularity, local"):
        make_runtime("docker", state_dir=str(tmp_path))


def test_runtimes_by_name_and_alias(tmp_path):
    from sandbox.factory import ALIASES, RUNTIMES
    from sandbox.local import LocalRuntime

    assert {name: cls.kind for name, cls in RUNTIMES.items()} == {n: n for n in ("bubblewrap", "singularity", "local")}
    assert {a: RUNTIMES[k].kind for a, k in ALIASES.items()} == {"bwrap": "bubblewrap", "apptainer": "singularity"}
    rt = make_runtime("LOCAL", state_dir=str(tmp_path))  # names are case-insensitive
    assert type(rt) is LocalRuntime


def test_spec_rejects_bad_network_and_relative_workdir():
    with pytest.raises(ValueError, match="network"):
        SandboxSpec(network="internet")
    with pytest.raises(ValueError, match="absolute"):
        SandboxSpec(workdir="ws")


CTX = LaunchContext(sandbox_id="sb-1", run_dir="/state/run/sb-1", workspace="/scratch/ws1",
                    sandbox_run_dir="/run/prorl", sandbox_workspace="/workspace", python="/usr/bin/python3",
                    pythonpath=[], address=None)


def test_unprivileged_bwrap_isolates_everything_and_dies_with_parent():
    argv = build_bwrap_command("bwrap", SandboxSpec(), CTX, privileged=False)
    assert argv[:3] == ["bwrap", "--unshare-all", "--die-with-parent"]
    assert "--share-net" not in argv
    i = argv.index("--bind")
    assert argv[i:i + 6] == ["--bind", "/state/run/sb-1", "/run/prorl", "--bind", "/scratch/ws1", "/workspace"]
    assert argv[argv.index("--") + 1:][:4] == ["/usr/bin/python3", "-S", "-c", SERVER_ENTRY]
    # Every host path is read-only except the two binds above.
    writable = [argv[k + 1] for k, a in enumerate(argv) if a == "--bind"]
    assert writable == ["/state/run/sb-1", "/scratch/ws1"]
    assert "--share-net" in build_bwrap_command("bwrap", SandboxSpec(network="loopback"), CTX)


def test_state_dir_defaults_to_xdg_runtime_dir_never_shared_tmp(tmp_path, monkeypatch):
    from sandbox.ownership import default_state_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_state_dir() == str(tmp_path / "prorl")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_state_dir() == os.path.expanduser("~/.local/state/prorl")


@pytest.mark.real
async def test_local_runtime_says_it_is_not_isolated_and_cleans_up(runtime_options, caplog, procs):
    caplog.set_level(logging.WARNING, logger="sandbox.local")
    rt = make_runtime("local", **runtime_options)
    assert not rt.isolated
    h = await rt.start()
    assert h.sandbox_id.startswith("unisolated-")
    assert any("NOT isolated" in r.message for r in caplog.records)
    r = await h.bash("pwd; sleep 1000 & nohup sleep 1001 >/dev/null 2>&1 &")
    assert r.output.startswith(f"{h.workspace}\n")
    await h.ipython("1")
    pids = {p.pid for p in procs.of(h)}
    assert len(pids) >= 5
    await h.close()
    procs.assert_gone(pids)


def _hold_all(lease_dir, network, ready, stop):
    alloc = LoopbackAllocator(lease_dir, network)
    leases = [alloc.allocate("child") for _ in range(6)]
    ready.put([lease.address for lease in leases])
    stop.wait(60)


def test_loopback_addresses_are_exclusive_across_processes_and_reclaimed_after_crash(tmp_path):
    lease_dir, network = str(tmp_path / "leases"), "127.200.0.0/29"  # 6 usable addresses
    ctx = multiprocessing.get_context("fork")
    ready, stop = ctx.Queue(), ctx.Event()
    holder = ctx.Process(target=_hold_all, args=(lease_dir, network, ready, stop))
    holder.start()
    try:
        held = ready.get(timeout=30)
        assert len(set(held)) == 6 and all(a.startswith("127.200.0.") for a in held)
        alloc = LoopbackAllocator(lease_dir, network)
        with pytest.raises(SandboxError, match="no free loopback address"):
            alloc.allocate()
    finally:
        holder.kill()  # a crash: the holder never releases
        holder.join()
    mine = [alloc.allocate("me") for _ in range(6)]
    assert sorted(lease.address for lease in mine) == sorted(held)
    for lease in mine:
        lease.release()
        lease.release()  # idempotent
    assert os.listdir(lease_dir) == []


def test_bwrap_writable_tmpfs_uses_overlays_or_is_refused_clearly():
    spec = SandboxSpec(writable_tmpfs=True)
    with pytest.raises(SandboxError, match="writable_tmpfs needs bubblewrap >= 0.9"):
        build_bwrap_command("bwrap", spec, CTX, overlay=False)
    argv = build_bwrap_command("bwrap", spec, CTX, overlay=True)
    assert ["--overlay-src", "/usr", "--tmp-overlay", "/usr"] == argv[argv.index("/usr") - 1:][:4]


def test_bwrap_without_image_binds_only_system_dirs_and_masks_etc_secrets(tmp_path):
    from sandbox.bubblewrap import ETC_SECRETS, HOST_SYSTEM_DIRS, SYS_CPU_DIR
    from sandbox.runtime import project_root

    from sandbox.python_view import VIEW_ROOT, python_view

    view = python_view(None, str(tmp_path / "view"), os.path.join(project_root(), "sandbox"))
    argv = build_bwrap_command("bwrap", SandboxSpec(), dataclasses.replace(CTX, view=view))
    top = {argv[k + 2] for k, a in enumerate(argv) if a in ("--ro-bind", "--symlink") and argv[k + 2].count("/") == 1}
    assert top <= {"/" + d for d in HOST_SYSTEM_DIRS} | {VIEW_ROOT} and "/usr" in top and "/etc" in top
    for home in ("/home", "/root", "/opt", "/var", "/srv", "/mnt"):
        assert not any(argv[k + 2] == home for k, a in enumerate(argv) if a in ("--ro-bind", "--bind")), home
    # The project: only its sandbox package, never the checkout (configs, tokens, datasets), and nothing at a
    # host path outside the system directories.
    binds = [(argv[k + 1], argv[k + 2]) for k, a in enumerate(argv) if a in ("--ro-bind", "--bind")]
    assert (os.path.join(os.path.realpath(project_root()), "sandbox"), f"{VIEW_ROOT}/server/sandbox") in binds
    assert os.path.realpath(project_root()) not in {h for h, _ in binds}
    assert all(c.startswith(("/usr", "/etc", "/bin", "/sbin", "/lib", VIEW_ROOT, "/run/prorl", "/workspace"))
               or c == SYS_CPU_DIR for _, c in binds), binds  # of /sys only the CPU topology
    for rel in ETC_SECRETS:
        path = os.path.join("/etc", rel)
        if os.path.lexists(path) and not os.path.islink(path):
            i = max(k for k, a in enumerate(argv) if a == path)
            assert argv[i - 1] == "--tmpfs" or argv[i - 2:i] == ["--ro-bind", "/dev/null"], path
    # A spec's image replaces the host view entirely; host_dirs adds to the allow-list.
    rootfs = tmp_path / "rootfs"
    (rootfs / "home").mkdir(parents=True)
    assert "/home" in build_bwrap_command("bwrap", SandboxSpec(image=str(rootfs)), CTX)
    argv = build_bwrap_command("bwrap", SandboxSpec(), CTX, host_dirs=HOST_SYSTEM_DIRS + ("opt",))
    assert ("/opt" in argv) == os.path.isdir("/opt")
