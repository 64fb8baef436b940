"""The reference trainer's set-up: vLLM serving under ``--served-model-name`` on an offline node. The server
takes the tokenizer from the model path the backend reports (``root`` in ``GET /v1/models``) or from the
``--tokenizer`` setting, and never from a hub lookup by the served name (which retries for about a minute per
job offline): a tokenizer that is not local fails at once with an error that names the fix. Also the
``--tokenizer`` and ``prorl-run`` ``PRORL_TOKEN`` flags."""
from __future__ import annotations

import pytest
from aiohttp import web

from prorl_server.balancer import Backend, BackendPool
from prorl_server.llm.context import LLMContext, TokenizerUnavailableError


@pytest.fixture
def models_endpoint(aiohttp_server):
    """A stand-in for vLLM's ``GET /v1/models`` answer only (its documented shape: ``id`` = the served model
    name, ``root`` = the ``--model`` path); no generation is asked of it here."""
    async def make(card):
        async def models(request):
            return web.json_response({"object": "list", "data": [{"object": "model", **card}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        server = await aiohttp_server(app)
        return f"http://127.0.0.1:{server.port}"

    return make


def _backend(address: str) -> Backend:
    pool = BackendPool()
    pool.add(address)
    return pool.backends[0]


async def test_tokenizer_comes_from_the_served_models_root(models_endpoint, tiny_model_dir, tokenizer):
    address = await models_endpoint({"id": "policy", "root": str(tiny_model_dir), "max_model_len": 2048})
    llm = LLMContext(BackendPool())
    try:
        tok = await llm.tokenizer(_backend(address))
    finally:
        await llm.close()
    assert tok.get_vocab() == tokenizer.get_vocab()


async def test_a_served_name_that_is_not_local_fails_at_once_naming_the_fix(models_endpoint, monkeypatch,
                                                                            tmp_path):
    # An empty Hugging Face cache: the name resolves nowhere locally; only a hub lookup could find it.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    address = await models_endpoint({"id": "policy", "root": "some-org/not-a-local-model"})
    llm = LLMContext(BackendPool())
    try:
        with pytest.raises(TokenizerUnavailableError, match="--tokenizer") as e:
            await llm.tokenizer(_backend(address))
    finally:
        await llm.close()
    assert "some-org/not-a-local-model" in str(e.value)


async def test_the_tokenizer_setting_wins_over_the_backend(models_endpoint, tiny_model_dir, tokenizer):
    address = await models_endpoint({"id": "policy", "root": "some-org/not-a-local-model"})
    llm = LLMContext(BackendPool(), tokenizer=str(tiny_model_dir))
    try:
        tok = await llm.tokenizer(_backend(address))
    finally:
        await llm.close()
    assert tok.get_vocab() == tokenizer.get_vocab()


def test_tokenizer_flag_sets_the_setting(tmp_path):
    from prorl_server.cli import settings_from_args

    assert settings_from_args(["--tokenizer", str(tmp_path)]).tokenizer == str(tmp_path)
    assert settings_from_args([]).tokenizer is None


def test_prorl_run_token_falls_back_to_prorl_token(monkeypatch):
    """The token comes from --token-file, else PRORL_TOKEN, else none (never from argv: see
    tests/trainer/test_fleet.py for the refusal)."""
    from trainer_plugins.run_job import build_parser, read_token

    monkeypatch.setenv("PRORL_TOKEN", "from-env")
    assert read_token(build_parser().parse_args(["--dataset", "arithmetic"])) == "from-env"
    monkeypatch.delenv("PRORL_TOKEN")
    assert read_token(build_parser().parse_args(["--dataset", "arithmetic"])) is None


async def test_a_missing_tokenizer_is_a_configuration_fault_a_trainer_stops_on(models_endpoint, monkeypatch,
                                                                              tmp_path, aiohttp_client):
    """Before, the job failed with a filtered ``handler``/``llm_backend`` kind and a trainer regenerated it
    forever; a tokenizer that cannot be loaded fails it as ``configuration``, and the trainer's client raises
    :class:`trainer_plugins.jobs.ConfigurationError` with the server's message."""
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings
    from prorl_server.plugin.registry import HandlerRegistry
    from prorl_server.types import ProcessRequest
    from trainer_plugins.jobs import ConfigurationError, JobSubmitter

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    address = await models_endpoint({"id": "policy", "root": "some-org/not-a-local-model"})
    registry = HandlerRegistry()
    registry.load_entry_points()
    client = await aiohttp_client(create_app(ServerSettings(backends=[address], health_interval_s=3600,
                                                            sandbox_runtime="none"), registry=registry))
    r = await client.post("/process", json={"instance": {"data_source": "shout", "prompt": "hi"}})
    body = await r.json()
    assert (body["failure_kind"], body["filter"]) == ("configuration", True), body
    assert "--tokenizer" in body["error"]
    jobs = JobSubmitter()
    try:
        with pytest.raises(ConfigurationError, match="--tokenizer"):
            await jobs.submit(str(client.make_url("")).rstrip("/"),
                              ProcessRequest(instance={"data_source": "shout", "prompt": "hi"}, job_id="cfg-1"))
    finally:
        await jobs.close()
