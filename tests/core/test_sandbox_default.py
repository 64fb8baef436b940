"""A server chooses a sandbox runtime where one works, says which at start, and a server that cannot run a
handler refuses its jobs at submit with a reason a client can tell from a transient fault (before: the default
was no runtime, every ``math`` job failed in init with ``filter: true`` and a trainer re-rolled it forever)."""
from __future__ import annotations

import logging
import shutil

import pytest

from prorl_server.app import build_components, create_app, resolve_sandbox_runtime
from prorl_server.config import ServerSettings
from prorl_server.plugin.registry import HandlerRegistry


def _registry() -> HandlerRegistry:
    r = HandlerRegistry()
    r.load_entry_points()
    return r


def test_auto_is_bubblewrap_where_bwrap_is_installed(monkeypatch):
    assert ServerSettings().sandbox_runtime == "auto"
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/bwrap" if name == "bwrap" else None)
    assert resolve_sandbox_runtime("auto") == "bubblewrap"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert resolve_sandbox_runtime("auto") is None
    assert resolve_sandbox_runtime("none") is None and resolve_sandbox_runtime(None) is None
    assert resolve_sandbox_runtime("singularity") == "singularity"


def test_the_start_says_why_there_is_no_runtime(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="prorl_server.app")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    c = build_components(ServerSettings(), _registry())
    assert c.runtime is None
    (msg,) = [r.getMessage() for r in caplog.records if "sandbox runtime" in r.getMessage()]
    assert "bwrap is not installed" in msg and "math" in msg and "code" in msg


def test_the_start_says_which_runtime_it_chose(caplog):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here")
    caplog.set_level(logging.INFO, logger="prorl_server.app")
    c = build_components(ServerSettings(), _registry())
    assert type(c.runtime).__name__ == "BubblewrapRuntime"
    assert any("sandbox runtime: bubblewrap (auto" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("instance", [{"data_source": "math", "question": "1+1?", "answer": "2"},
                                      {"data_source": "code", "instance_id": "HumanEval/0"}])
async def test_a_server_without_sandboxes_refuses_their_jobs_at_submit(aiohttp_client, instance):
    app = create_app(ServerSettings(backends=["http://127.0.0.1:9"], health_interval_s=3600,
                                    sandbox_runtime="none"), registry=_registry())
    client = await aiohttp_client(app)
    for route in ("/process", "/jobs"):
        r = await client.post(route, json={"instance": instance})
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert err["type"] == "handler_unavailable" and "sandbox runtime" in err["message"], err
    # a handler that needs no sandbox still runs there
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "1+1",
                                                         "answer": 2}})
    assert r.status == 200
