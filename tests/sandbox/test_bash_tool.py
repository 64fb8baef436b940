"""The bash tool through the whole path (host client → socket → execution server → pty bash in bubblewrap)."""
from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = [pytest.mark.real]


async def test_cwd_env_and_functions_persist_between_calls(sandbox):
    await sandbox.bash("mkdir -p sub && cd sub && export GREETING=hello && f() { echo fn-$1; }")
    r = await sandbox.bash('pwd; echo "$GREETING"; f x')
    assert r.output == "/workspace/sub\nhello\nfn-x\n"
    assert r.exit_code == 0 and not r.timed_out


async def test_multiline_command_with_heredoc_runs_as_one_call(sandbox):
    r = await sandbox.bash("cat > note.txt <<'EOF'\nline $1\nsecond\nEOF\nwc -l < note.txt\nfalse")
    assert r.output == "2\n"
    assert r.exit_code == 1  # status of the last command


async def test_long_command_beyond_tty_line_limit_is_not_cut(sandbox):
    payload = "x" * 20000  # the tty's canonical line limit is 4096 bytes
    r = await sandbox.bash(f"s='{payload}'; echo ${{#s}}")
    assert r.output == "20000\n"


async def test_exit_code_of_failed_command_is_reported(sandbox):
    r = await sandbox.bash("ls /does-not-exist")
    assert r.exit_code == 2
    assert "No such file or directory" in r.output


async def test_timeout_interrupts_command_and_returns_partial_output(sandbox):
    await sandbox.bash("cd /tmp && X=kept")
    t0 = time.monotonic()
    r = await sandbox.bash("echo started; sleep 60; echo never", timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert r.timed_out and r.exit_code == 130
    assert r.output.startswith("started\n") and "never" not in r.output
    assert "timed out" in r.output
    r2 = await sandbox.bash("echo $X; pwd")  # the shell survived the interrupt with its state
    assert r2.output == "kept\n/tmp\n"


async def test_command_ignoring_ctrl_c_is_killed_on_timeout(sandbox):
    r = await sandbox.bash("trap '' INT; sleep 60", timeout_s=0.5)
    assert r.timed_out
    assert (await sandbox.bash("echo alive")).output == "alive\n"


async def test_output_beyond_limit_is_truncated_with_notice(sandbox):
    r = await sandbox.bash("head -c 3000000 /dev/zero | tr '\\0' a", max_output_bytes=1000)
    assert r.truncated and r.exit_code == 0
    assert r.output_bytes == 3000000
    assert r.output.startswith("a" * 1000)
    assert "[output truncated: showing the first 1000 of 3000000 bytes]" in r.output
    assert len(r.output) < 1200


async def test_endless_output_is_bounded_and_interrupted(sandbox):
    r = await sandbox.bash("yes 0123456789abcdef", timeout_s=3.0, max_output_bytes=10000)
    assert r.timed_out and r.truncated
    assert r.output_bytes > 10_000_000  # tens of MB streamed through, only 10 kB kept
    assert len(r.output) < 10300
    assert (await sandbox.bash("echo ok")).output == "ok\n"


async def test_binary_output_is_decoded_with_replacement(sandbox):
    r = await sandbox.bash("printf 'a\\xff\\xfeb\\n'")
    assert r.output == "a\ufffd\ufffdb\n"


async def test_shell_exit_starts_a_fresh_shell(sandbox):
    r = await sandbox.bash("exit 7")
    assert r.exit_code == 7 and "shell exited" in r.output
    r2 = await sandbox.bash("echo again; pwd")
    assert r2.output == "again\n/workspace\n"


async def test_concurrent_calls_are_serialised_not_interleaved(sandbox):
    results = await asyncio.gather(*(sandbox.bash(f"echo start-{i}; sleep 0.05; echo end-{i}") for i in range(5)))
    for i, r in enumerate(results):
        assert r.output == f"start-{i}\nend-{i}\n"


async def test_dropped_connection_reattaches_without_rerunning_command(sandbox):
    task = asyncio.create_task(sandbox.bash("echo run >> runs.txt; sleep 1; wc -l < runs.txt"))
    await asyncio.sleep(0.3)
    sandbox._client._writer.transport.abort()  # the socket breaks mid-command
    r = await task
    assert r.output == "1\n"
    assert (await sandbox.download("runs.txt")) == b"run\n"


async def test_request_lost_in_a_broken_connection_is_sent_again_exactly_once(sandbox):
    await sandbox.bash("true")
    sandbox._client._writer.transport.abort()  # broken before the request is written: the server never sees it
    r = await sandbox.bash("echo run >> runs.txt; wc -l < runs.txt")
    assert r.output == "1\n"


async def test_files_round_trip_and_transfer_errors_are_clear(sandbox):
    from sandbox import FileTransferError

    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    path = await sandbox.upload("bin/blob.dat", blob, mode=0o600)
    assert path == "/workspace/bin/blob.dat"
    assert await sandbox.download("bin/blob.dat") == blob
    assert (await sandbox.bash("stat -c %a bin/blob.dat")).output == "600\n"
    with pytest.raises(FileTransferError, match="larger than max_bytes=100"):
        await sandbox.download("bin/blob.dat", max_bytes=100)
    with pytest.raises(FileTransferError, match="No such file"):
        await sandbox.download("missing.txt")
    with pytest.raises(FileTransferError, match="Read-only|Permission"):
        await sandbox.upload("/usr/evil", b"x")
    with pytest.raises(FileTransferError, match="upload of .* refused"):
        await sandbox.upload("huge.bin", b"\0" * (47 * 1024 * 1024))
    assert (await sandbox.bash("echo still-fine")).output == "still-fine\n"
