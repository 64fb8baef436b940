"""Fixtures for the handler tests: a rollout server with the shipped handlers on real bubblewrap sandboxes.
The scripted policy (a labelled test double standing in for a capable model) is in tests/conftest.py;
everything else in these tests is real: server, pipeline, agent loop, sandboxes, evaluation.
"""
from __future__ import annotations


import pytest

from prorl_server.plugin.registry import HandlerRegistry


@pytest.fixture
def registry():
    r = HandlerRegistry()
    r.load_entry_points()
    return r


@pytest.fixture
def rollout_server(aiohttp_client, registry, bwrap_runtime):
    """``async (backends: list[str], **settings) -> client`` of a real server with the shipped handlers."""
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    async def make(backends, **settings):
        settings.setdefault("health_interval_s", 3600)
        app = create_app(ServerSettings(backends=backends, **settings), registry=registry,
                         sandbox_runtime=bwrap_runtime)
        return await aiohttp_client(app)

    return make
