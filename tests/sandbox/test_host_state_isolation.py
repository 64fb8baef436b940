"""Nothing a sandbox can write decides what the host kills, and a sandbox without an image sees only the host's
system directories: real bubblewrap sandboxes (and the local runtime for its own sessions file)."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import psutil
import pytest

from sandbox import SandboxSpec, make_runtime
from sandbox.runtime import SESSIONS_NAME, project_root
from sandbox.sessions import start_ticks

pytestmark = [pytest.mark.real]

# Secrets under /etc that exist on common nodes: password hashes, host keys, sudo rules, Slurm's munge key.
ETC_SECRETS = ("shadow", "gshadow", "ssh", "ssl/private", "sudoers", "sudoers.d", "munge", "pip.conf")


@pytest.fixture
def victim():
    """An unrelated host process (its own session, as a tool session leader would be) that no sandbox may
    get killed."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None and psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE


def _forge_script(victim_pid: int) -> str:
    """Shell text run inside a sandbox: writes, in every file name the host has ever read from a run
    directory, a sessions list naming ``victim_pid`` with its true start time, and an ownership-record-like
    file naming it as the sandbox's launcher with the host server as a dead owner."""
    sessions = json.dumps({"bash": {"pid": victim_pid, "start_ticks": start_ticks(victim_pid)},
                           "kernel": {"pid": victim_pid, "start_ticks": start_ticks(victim_pid)}})
    record = json.dumps({"sandbox_id": "sb-forged", "runtime": "local", "pid": victim_pid,
                         "create_time": psutil.Process(victim_pid).create_time(), "owner_pid": 1,
                         "owner_create_time": 0.0})
    return (f"cd \"$RUN\" && printf '%s' '{sessions}' > {SESSIONS_NAME} && mkdir -p sandboxes && "
            f"printf '%s' '{record}' > sandboxes/sb-forged.json && printf '%s' '{record}' > sb-forged.json && "
            "echo forged")


async def test_forged_sessions_file_from_bubblewrap_sandbox_kills_nothing_on_close(bwrap_runtime, victim, procs):
    h = await bwrap_runtime.start()
    r = await h.bash("RUN=/run/prorl; " + _forge_script(victim.pid), timeout_s=20)
    assert r.output.strip().endswith("forged"), r.output
    # The forgery really is on the host side, where the old close read it.
    with open(os.path.join(h._ctx.run_dir, SESSIONS_NAME)) as f:
        assert json.load(f)["bash"]["pid"] == victim.pid
    pids = {p.pid for p in procs.of(h)}
    await h.close()
    procs.assert_gone(pids)
    assert _alive(victim)


async def test_forged_files_from_bubblewrap_sandbox_kill_nothing_when_reaped(bwrap_runtime, runtime_options,
                                                                             victim, procs, monkeypatch):
    import sandbox.runtime

    # This process plays both the crashed server and the next one, so the sandbox's launcher is still its child;
    # after a real SIGKILL it would be re-parented to init (or a subreaper). Stand for that: this process counts
    # as an adopter of orphans, or the reaper rightly leaves a sandbox whose parent is alive (a live server's).
    adopters = sandbox.runtime.orphan_adopters
    monkeypatch.setattr(sandbox.runtime, "orphan_adopters", lambda: adopters() | {os.getpid()})
    h = await bwrap_runtime.start()
    r = await h.bash("RUN=/run/prorl; " + _forge_script(victim.pid), timeout_s=20)
    assert r.output.strip().endswith("forged"), r.output
    pids = {p.pid for p in procs.of(h)}
    # The server that started it "crashed": its record now names an owner that is gone (a process that ran
    # and exited), as a record left by a SIGKILLed server does.
    gone = subprocess.Popen(["true"])
    gone.wait()
    (rec,) = [r for r in bwrap_runtime.store.records() if r["sandbox_id"] == h.sandbox_id]
    bwrap_runtime.store.write({**rec, "owner_pid": gone.pid, "owner_create_time": 1.0})
    later = make_runtime("bubblewrap", **runtime_options)
    assert await later.reap_orphans() == 1
    procs.assert_gone(pids)
    assert _alive(victim)
    assert later.store.records() == []


async def test_forged_sessions_file_of_local_runtime_kills_only_its_own_sessions(runtime_options, victim, procs):
    rt = make_runtime("local", **runtime_options)
    h = await rt.start()
    try:
        # A real tool process of the sandbox (in the shell's session): must die on close.
        r = await h.bash("sleep 1000 & echo $!", timeout_s=20)
        tool = int(r.output.split()[-1])
        own = {p.pid for p in procs.of(h)} | {tool}
        # Keep the real entry (bash) and add the victim under another name, as code in a local sandbox can.
        path = os.path.join(h._ctx.run_dir, SESSIONS_NAME)
        forge = (f"import json; d = json.load(open({path!r})); "
                 f"d['kernel'] = {{'pid': {victim.pid}, 'start_ticks': {start_ticks(victim.pid)}}}; "
                 f"json.dump(d, open({path!r}, 'w'))")
        r = await h.bash(f"{sys.executable} -c \"{forge}\" && echo forged", timeout_s=30)
        assert r.output.strip().endswith("forged"), r.output
    finally:
        await h.close()
    procs.assert_gone(own)
    assert _alive(victim)


@pytest.mark.parametrize("where", ["workspace", "workspace_root", "rw_bind"])
async def test_sandbox_writable_mount_over_host_state_is_refused(runtime_options, where):
    state = runtime_options["state_dir"]
    options = dict(runtime_options)
    spec = SandboxSpec()
    if where == "workspace":
        spec = SandboxSpec(workspace=os.path.join(state, "sandboxes"))
    elif where == "workspace_root":
        options["workspace_root"] = os.path.join(state, "ws")
    else:
        spec = SandboxSpec(binds=[(os.path.dirname(state), "/mnt/up", False)])
    rt = make_runtime("bubblewrap", **options)
    with pytest.raises(ValueError, match="overlaps the host state directory"):
        await rt.start(spec)
    assert rt.handles == [] and os.listdir(os.path.join(state, "run")) == []


@pytest.fixture
def host_secrets():
    """Readable files where a server's secrets live: the home directory (tokens, ~/.ssh), the project tree
    (a servers.json with a bearer token) and, for a root server, another user's home under /home."""
    tag = secrets.token_hex(4)
    dirs = [os.path.expanduser("~"), project_root()]
    made = []
    if os.geteuid() == 0:
        home = f"/home/prorl-test-{tag}"
        os.makedirs(home, mode=0o755)
        made.append(home)
        dirs.append(home)
    files = []
    for d in dirs:
        path = os.path.join(d, f"servers-{tag}.json")
        with open(path, "w") as f:
            f.write('{"token": "SECRET-%s"}' % tag)
        os.chmod(path, 0o644)  # readable by anyone, the sandbox's user included: only the mount hides it
        files.append(path)
    yield files
    for path in files:
        os.unlink(path)
    for d in made:
        os.rmdir(d)


async def test_default_view_hides_home_project_and_etc_secrets(sandbox, host_secrets):
    for path in host_secrets:
        r = await sandbox.bash(f"cat {path} || echo UNREADABLE", timeout_s=20)
        assert "SECRET" not in r.output and "UNREADABLE" in r.output, (path, r.output)
    r = await sandbox.bash("ls -A /", timeout_s=20)
    assert not set(r.output.split()) & {"home", "opt", "var", "srv", "mnt", "media", "boot"}, r.output
    for rel in ETC_SECRETS:
        path = os.path.join("/etc", rel)
        if os.path.isfile(path) and not os.path.islink(path):
            r = await sandbox.bash(f"wc -c < {path} 2>/dev/null || echo 0", timeout_s=20)
            assert r.output.split()[-1] == "0", (path, r.output)
        elif os.path.isdir(path) and not os.path.islink(path):
            r = await sandbox.bash(f"ls -A {path} | wc -l", timeout_s=20)
            assert r.output.split()[-1] == "0", (path, r.output)
    # What the tools need is still there: the system, and an interpreter with the allowed packages (its Python
    # view: the host interpreter's own path is not part of it).
    r = await sandbox.bash("python3 -c 'import ptyprocess, numpy; print(42)'; ls /usr/bin/env", timeout_s=30)
    assert r.output.split() == ["42", "/usr/bin/env"], r.output


async def test_socket_replaced_by_link_to_a_host_socket_is_refused(sandbox, short_tmp, procs):
    """The execution server's socket lies in the sandbox-writable run directory: code in the sandbox can
    swap it for a link to another host socket (here one that answers every request with a forged success)."""
    import asyncio
    import base64

    received = []

    async def forger(reader, writer):
        while line := await reader.readline():
            received.append(line)
            rid = json.loads(line)["id"]
            writer.write(json.dumps({"id": rid, "ok": True, "result": {
                "data_b64": base64.b64encode(b"FORGED").decode(), "path": "/x"}}).encode() + b"\n")
            await writer.drain()

    decoy = os.path.join(short_tmp, "decoy.sock")
    server = await asyncio.start_unix_server(forger, decoy)
    try:
        await sandbox.upload("answer.txt", b"real")
        r = await sandbox.bash(f"cd /run/prorl && ln -sf {decoy} exec.sock.new && mv -f exec.sock.new exec.sock "
                               "&& echo swapped", timeout_s=20)
        assert r.output.strip() == "swapped"
        sandbox._client._drop_connection()  # a dropped connection: the next call connects by path again
        from sandbox.errors import ProtocolError

        with pytest.raises(ProtocolError, match="not part of the sandbox"):
            await sandbox.download("answer.txt")
        assert received == []
    finally:
        server.close()
        await server.wait_closed()


def test_launcher_log_link_planted_in_run_dir_is_not_followed(tmp_path):
    from sandbox.runtime import LOG_NAME, SandboxRuntime

    secret = tmp_path / "servers.json"
    secret.write_text('{"token": "SECRET"}')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOG_NAME).symlink_to(secret)
    assert "SECRET" not in SandboxRuntime._log_tail(str(run_dir))
    (run_dir / LOG_NAME).unlink()
    (run_dir / LOG_NAME).write_bytes(b"x" * 5000 + b"the end")
    assert SandboxRuntime._log_tail(str(run_dir), 7) == "the end"
