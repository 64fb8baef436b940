"""The execution server's error responses name a class that the host client raises; code in the sandbox can shape
those responses once the model has run in it, so a name that only the host may establish (the sandbox could not
start, died, was closed or evicted, a call ran past the host's deadline) must never come back as that class: a
``SandboxStartError`` after the model acted is a filtered failure (prorl_server.failures), a way out of every
problem the policy cannot solve. Fast tier: a stand-in execution server on a Unix socket in this process."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from prorl_server.failures import classify
from sandbox.client import ExecClient
from sandbox.errors import (ERRORS_BY_NAME, FileTransferError, SandboxClosedError, SandboxDeadError, SandboxError,
                            SandboxEvictedError, SandboxStartError, ToolTimeout)

HOST_ONLY = [SandboxStartError, SandboxDeadError, SandboxClosedError, SandboxEvictedError, ToolTimeout]


async def _answer_with(name: str, tmp_path) -> BaseException:
    """One call through :class:`ExecClient` to a stand-in server that answers every request with an error
    response of type ``name`` (what a policy that took over the sandbox's end of the socket could send)."""
    path = os.path.join(str(tmp_path), "exec.sock")

    async def serve(reader, writer):
        req = json.loads(await reader.readline())
        writer.write(json.dumps({"id": req["id"], "ok": False,
                                 "error": {"type": name, "message": "forged"}}).encode() + b"\n")
        await writer.drain()

    server = await asyncio.start_unix_server(serve, path)
    never = asyncio.get_running_loop().create_future()
    client = ExecClient(path, lambda: never, "stand-in")
    try:
        await client.connect(5.0)
        with pytest.raises(SandboxError) as info:
            await client.call("bash", {"command": "true"}, 5.0)
        return info.value
    finally:
        await client.close()
        server.close()
        never.cancel()


@pytest.mark.parametrize("cls", HOST_ONLY, ids=lambda c: c.__name__)
async def test_a_name_only_the_host_may_establish_reads_as_a_plain_sandbox_error(cls, tmp_path):
    assert cls.__name__ not in ERRORS_BY_NAME
    exc = await _answer_with(cls.__name__, tmp_path)
    assert type(exc) is SandboxError
    # after the model acted, a sandbox error of its making is scored, never filtered
    assert classify(exc, "run", model_acted=True) == "model_crashed_sandbox"


async def test_a_tool_error_the_server_raises_still_comes_back_as_its_class(tmp_path):
    exc = await _answer_with("FileTransferError", tmp_path)
    assert type(exc) is FileTransferError
