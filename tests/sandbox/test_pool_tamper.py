"""Pool fault of #36 from the red team's fourth pass (row 2): a co-tenant of the same uid connects to a waiting
pooled sandbox's execution server socket (its state directory is the server's own, 0700: only the same uid or
root reaches it) and runs commands there, leaving a running ``sleep`` and files. The job that gets the sandbox
must not pay for it: the model's first call fails as the system's (:class:`SandboxStartError`, filtered) because
the server took more requests than the host sent. Real tier: bubblewrap sandboxes; the co-tenant is a plain
:class:`sandbox.client.ExecClient` on the sandbox's socket, as the red team's script used."""
from __future__ import annotations

import asyncio
import os

import pytest

from prorl_server.failures import classify, is_filtered
from sandbox import SandboxStartError
from sandbox.client import ExecClient
from sandbox.runtime import SOCKET_NAME
from sandbox.system_time import system_seconds
from tests.sandbox.conftest import BWRAP_UNAVAILABLE
from tests.sandbox.test_pool import SPEC, full_pool

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]


async def _never() -> None:
    await asyncio.sleep(3600)


async def test_a_pooled_sandbox_a_cotenant_used_fails_the_models_first_call_as_the_systems(bwrap_runtime):
    async with full_pool(bwrap_runtime) as pool:
        (waiting,) = bwrap_runtime.handles
        cotenant = ExecClient(os.path.join(waiting._ctx.run_dir, SOCKET_NAME), _never, "co-tenant")
        try:
            await cotenant.connect(5)
            await cotenant.call("bash", {"command": "echo planted > /workspace/planted; sleep 30 &",
                                         "timeout_s": 5}, 10)
            # a foreground command of theirs still runs when the job gets the sandbox
            busy = asyncio.ensure_future(cotenant.call("bash", {"command": "sleep 30", "timeout_s": 60}, 70))
            await asyncio.sleep(0.2)
            h = await pool.acquire(SPEC)
            assert h.sandbox_id == waiting.sandbox_id  # acquire does not ask the server (no round trip there)
            with system_seconds():  # on the model's behalf, as the agent loop calls it
                with pytest.raises(SandboxStartError) as err:  # before: "a bash command is already running"
                    await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
            assert "tampered" in str(err.value)
            kind = classify(err.value, "run", model_acted=True)
            assert kind == "sandbox" and is_filtered(kind)
            busy.cancel()
            await h.close()
        finally:
            await cotenant.close()


async def test_the_hosts_own_setup_calls_do_not_read_as_tampering(bwrap_runtime):
    async with full_pool(bwrap_runtime) as pool:
        h = await pool.acquire(SPEC)
        # a handler's setup (outside the model's accounting), then the model's first calls
        await h.upload("task.txt", b"x")
        assert (await h.bash("cat task.txt", timeout_s=5)).output.strip() == "x"
        with system_seconds():
            assert (await h.bash("echo first", timeout_s=5)).output.strip() == "first"
            assert (await h.bash("echo second", timeout_s=5)).output.strip() == "second"
        await h.close()


def _break_the_first_send(client: ExecClient) -> list[bytes]:
    """The client's next request goes out half (stands for a connection that breaks mid-send, once): the server
    never decodes it, and the client reconnects, learns so (`unknown request`) and sends it again."""
    real_write = client._writer.write
    cut: list[bytes] = []

    def write(data: bytes) -> None:
        if not cut:
            cut.append(data)
            real_write(data[:len(data) // 2])
            client._writer.transport.abort()
            return
        real_write(data)

    client._writer.write = write
    return cut


async def test_a_request_resent_after_a_broken_connection_counts_once(bwrap_runtime):
    """The host's setup call is resent after a broken connection: it counts once on both sides, so the model's
    first call is not refused, and a co-tenant's single request after it is still seen (before, the host
    counted the resent request twice, which hid one request of someone else's)."""
    async with full_pool(bwrap_runtime) as pool:
        h = await pool.acquire(SPEC)
        await h._client.connect(5)
        cut = _break_the_first_send(h._client)
        await h.upload("task.txt", b"x")  # a handler's setup, outside the model's accounting
        assert cut, "the injected break did not happen"
        served = (await h._client.call("ping", {}, 5))["served"]
        assert served == h._client.sent
        with system_seconds():
            assert (await h.bash("cat task.txt", timeout_s=5)).output.strip() == "x"
        await h.close()

        h = await pool.acquire(SPEC)
        await h._client.connect(5)
        cut = _break_the_first_send(h._client)
        await h.upload("task.txt", b"x")
        assert cut
        cotenant = ExecClient(os.path.join(h._ctx.run_dir, SOCKET_NAME), _never, "co-tenant")
        try:
            await cotenant.connect(5)
            await cotenant.call("bash", {"command": "echo planted > /workspace/planted", "timeout_s": 5}, 10)
        finally:
            await cotenant.close()
        with system_seconds():
            with pytest.raises(SandboxStartError, match="tampered"):
                await h.bash("echo hi", timeout_s=5)
        await h.close()
