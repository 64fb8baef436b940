"""The cold start path (#36 part 2): each start reports where its time went, the host is woken by the execution
server's readiness signal instead of polling its socket, and the cached list of host package directories to mask
follows the host."""
from __future__ import annotations

import pytest

STEPS = {"probe", "view", "dirs", "leases", "config", "cgroup", "launch", "record", "ready", "pidns"}


@pytest.mark.real
async def test_a_start_reports_each_step(sandbox):
    assert set(sandbox.start_steps) == STEPS
    assert all(v >= 0 for v in sandbox.start_steps.values())
    assert sandbox.start_steps["ready"] > 0  # the launcher's exec until the execution server's first answer


@pytest.mark.real
async def test_start_is_woken_by_the_readiness_signal_not_the_poll(bwrap_runtime, monkeypatch):
    # With the fallback poll slower than the start timeout, only the signal lets the start finish (else it is a
    # SandboxStartError: the execution server did not listen within start_timeout_s).
    monkeypatch.setattr("sandbox.client.READY_FALLBACK_POLL_S", 60.0)
    bwrap_runtime.start_timeout_s = 5.0
    h = await bwrap_runtime.start()
    try:
        assert (await h.bash("echo ok")).output.strip() == "ok"
    finally:
        await h.close()


def test_the_masked_system_package_dirs_follow_the_host_while_cached(tmp_path, monkeypatch):
    # A sandbox start reuses the answer while the directories it depends on are unchanged; a package directory
    # of another Python that appears later must still be masked in the next sandbox.
    from sandbox import python_view

    lib = tmp_path / "usr" / "lib"
    (lib / "python3.99").mkdir(parents=True)
    monkeypatch.setattr(python_view, "SYSTEM_SITE_PATTERNS", (f"{lib}/python3*/dist-packages",))
    monkeypatch.setattr(python_view, "_SITE_DIRS_CACHE", {})
    assert python_view.system_site_dirs() == []
    (lib / "python3.99" / "dist-packages").mkdir()
    assert python_view.system_site_dirs() == [f"{lib}/python3.99/dist-packages"]
    (lib / "python3.98" / "dist-packages").mkdir(parents=True)
    assert python_view.system_site_dirs() == [f"{lib}/python3.98/dist-packages", f"{lib}/python3.99/dist-packages"]
    (lib / "python3.99" / "dist-packages").rmdir()
    assert python_view.system_site_dirs() == [f"{lib}/python3.98/dist-packages"]


# Modules whose import cost the execution server's start paid at every sandbox start (json -> re -> enum,
# socket and signal -> enum classes of every constant, selectors/functools -> collections): ~14 ms here.
SLOW_AT_START = {"json", "re", "enum", "socket", "signal", "selectors", "collections", "functools", "typing",
                 "asyncio"}


@pytest.mark.real  # a Python subprocess
def test_the_execution_server_starts_without_slow_imports():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sandbox.exec_server; "
            "print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-S", "-c", code, root], capture_output=True, text=True,
                                check=True).stdout.split())
    assert "sandbox.exec_server" in loaded
    assert loaded & SLOW_AT_START == set()


# Modules first needed by a tool, each a shared object to load or a module body to run (~2 ms at every start
# together): the first bash request, file transfer or editor call imports them, a start does not.
FIRST_USE_ONLY = {"os", "binascii", "termios", "resource", "heapq", "_heapq", "sandbox.bash_tool",
                  "sandbox.limits", "sandbox.sessions", "types"}  # types: never (MappingProxyType is a builtin's type)


@pytest.mark.real  # a Python subprocess
def test_the_execution_server_leaves_each_tool_s_modules_to_its_first_use(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sandbox.exec_server as e; "
            "s = e.ExecServer(sys.argv[2] + '/exec.sock', {'workspace': sys.argv[2], 'run_dir': sys.argv[2]}); "
            "print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-S", "-c", code, root, str(tmp_path)], capture_output=True,
                                text=True, check=True).stdout.split())
    assert "sandbox.exec_server" in loaded
    assert loaded & FIRST_USE_ONLY == set()


MESSAGES = [{"id": 1, "op": "bash", "args": {"command": "echo é\n\"\\\u2028\x00", "timeout_s": 2.5}},
            {"id": None, "ok": False, "error": {"type": "ToolError", "message": "x"}},
            {"id": 7, "ok": True, "result": {"n": 10 ** 30, "f": 1e308, "z": -0.0, "b": [True, False, None],
                                             "nan": float("nan"), "inf": float("-inf"), "empty": {}}}]


@pytest.mark.parametrize("msg", MESSAGES)
def test_the_wire_codec_writes_and_reads_what_json_does(msg):
    import json

    from sandbox import protocol

    line = protocol.encode(msg)
    assert line == json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    assert repr(protocol.decode(line)) == repr(json.loads(line))
    assert repr(protocol.decode(b" \t" + line + b"\r\n")) == repr(msg)


@pytest.mark.parametrize("line", [b"", b"  ", b"{", b"{} x", b"[1,]", b'{"a":1}{}', b'"\xff"', b"[1]",
                                  b"[" * 100_000 + b"]" * 100_000])
def test_the_wire_codec_refuses_what_is_not_one_json_object_with_a_value_error(line):
    # a request nested past the interpreter's stack is a bad request too (json.loads raised RecursionError,
    # which the execution server's request handling does not catch)
    from sandbox import protocol

    with pytest.raises(ValueError):
        protocol.decode(line)


@pytest.mark.real
async def test_a_cold_start_leaves_its_shell_to_the_first_bash_call_or_a_warm_up(bwrap_runtime):
    # A shell started right after every start (~15 ms of CPU) competed with the other starts of a burst: 64
    # concurrent starts took ~40% longer on 2 cores. A pool asks for it (warm_up) while its sandbox waits.
    import asyncio

    from tests.sandbox.conftest import live_processes

    h = await bwrap_runtime.start()
    try:
        await asyncio.sleep(0.3)
        assert "bash" not in [p.name() for p in live_processes(h)]
        await h.warm_up()
        for _ in range(250):
            if "bash" in [p.name() for p in live_processes(h)]:
                break
            await asyncio.sleep(0.02)
        assert "bash" in [p.name() for p in live_processes(h)]
        assert (await h.bash("echo ok")).output.strip() == "ok"
    finally:
        await h.close()


@pytest.mark.real
async def test_a_start_does_not_wait_for_the_pid_namespace_record_and_close_waits_for_it(bwrap_runtime, monkeypatch):
    # The record's rewrite with the sandbox's pid namespace ran between the first answer and the start's return
    # (a worker thread's round trip, ~0.7 ms of every start). Now it runs behind the start, and close must wait
    # for it: a rewrite landing after close removed the record would leave a closed sandbox's record behind.
    import asyncio
    import threading

    store = bwrap_runtime.store
    write, release, held = store.write, threading.Event(), []

    def slow_write(record):
        if "pidns" in record:  # the rewrite, not the first record (which must exist before the launcher runs)
            held.append(record["sandbox_id"])
            release.wait(10)
        write(record)

    monkeypatch.setattr(store, "write", slow_write)
    bwrap_runtime.start_timeout_s = 5.0
    h = await bwrap_runtime.start()  # before: held here until start_timeout_s, a SandboxStartError
    try:
        assert (await h.bash("echo ok")).output.strip() == "ok"
        assert held == [h.sandbox_id]
        closing = asyncio.ensure_future(h.close(grace_s=0.0))
        await asyncio.sleep(0.3)
        release.set()
        await closing
        assert store.records() == []
    finally:
        release.set()
        await h.close()


@pytest.mark.real
async def test_modules_in_the_workspace_never_shadow_the_execution_server_s_own(bwrap_runtime, tmp_path):
    # `python -c` puts the current directory, the workspace, first on sys.path: a repository with a top-level
    # select.py (imported at start) or binascii.py/heapq.py/os.py (imported at a tool's first use) replaced the
    # server's module, and the sandbox failed to start or its tools broke (the system's doing, not the model's).
    workspace = tmp_path / "repo"
    workspace.mkdir()
    for name in ("select", "binascii", "heapq", "os", "termios", "_json"):
        (workspace / f"{name}.py").write_text("raise SystemExit(3)\n")
    h = await bwrap_runtime.start(workspace=str(workspace))
    try:
        assert (await h.bash("echo ok")).output.strip() == "ok"
        assert await h.download("os.py") == b"raise SystemExit(3)\n"
        await h.upload("sub/x.txt", b"x")
        assert (await h.bash("cat sub/x.txt")).output.strip() == "x"
    finally:
        await h.close()
