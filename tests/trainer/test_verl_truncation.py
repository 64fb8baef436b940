"""Truncation is never silent (issue #22 item 5): a sample cut to verl's rollout lengths is masked (DAPO's
overlong filtering, the default) or filtered (``truncation: filter``), and counted.

Before: the prompt was cut from the left and the response at ``response_length`` with ``response_mask`` kept
at 1, while ``reward_score`` stayed the whole episode's: the kept tokens were trained with a reward earned by
tokens the trainer never saw, and the ``truncated`` flag was recorded and never used.

Real: the rollout server (the project's app on loopback) and verl's agent loop instantiation; the handler is
``FixedTrajectoryHandler`` (conftest), which stands in for an LLM handler by returning exact token ids.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")

_spec = importlib.util.spec_from_file_location("_verl_plugin_helpers", Path(__file__).with_name("test_verl_plugin.py"))
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)
cfg, worker = plugin.cfg, plugin.worker  # fixtures
P, R = plugin.PROMPT_LEN, plugin.RESPONSE_LEN
SP = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


@pytest.fixture
async def loop_on_server(cfg, worker, tokenizer, start_llm_server, monkeypatch):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    return lambda **settings: plugin.make_loop(cfg, tokenizer, **settings)


@pytest.mark.parametrize("prompt_len, response_len, cut", [
    (P, R + 3, {"prompt": 0, "response": 3}),  # a long episode
    (P + 7, R, {"prompt": 7, "response": 0}),  # a long context
])
async def test_a_cut_sample_is_masked_by_default_and_counted(loop_on_server, prompt_len, response_len, cut):
    from trainer_plugins.verl.agent_loop import ProRLAgentLoop

    loop = loop_on_server()
    assert loop.truncation == "mask"  # the YAML's default
    before = ProRLAgentLoop.truncation_counts["mask"]
    out = await loop.run(SP, **plugin.fixed_row(list(range(10, 10 + prompt_len)),
                                                list(range(500, 500 + response_len)), reward=1.0))
    assert len(out.prompt_ids) <= P and len(out.response_ids) <= R  # fits verl's rows
    assert out.response_mask == [0] * len(out.response_ids)  # trains nothing
    assert out.reward_score == 1.0  # DAPO's overlong filtering keeps it in the group's baseline
    assert out.extra_fields["prorl"]["truncated"] == cut and out.extra_fields["prorl"]["truncation"] == "mask"
    assert ProRLAgentLoop.truncation_counts["mask"] == before + 1


async def test_with_truncation_filter_a_cut_sample_is_a_filtered_row(loop_on_server):
    loop = loop_on_server(truncation="filter")
    out = await loop.run(SP, **plugin.fixed_row(list(range(10, 30)), list(range(500, 500 + R + 1)), reward=1.0))
    prorl = out.extra_fields["prorl"]
    assert prorl["filter"] is True and prorl["truncated"] == {"prompt": 0, "response": 1}
    assert out.response_mask == [0] and out.reward_score == 0.0  # ProRLReplayBuffer evicts its group


async def test_a_sample_that_fits_is_trained_as_it_is(loop_on_server):
    loop = loop_on_server()
    out = await loop.run(SP, **plugin.fixed_row(list(range(10, 10 + P)), list(range(500, 500 + R))))
    assert out.response_mask == [1] * R and out.extra_fields["prorl"]["truncated"] is None


def test_an_unknown_truncation_mode_is_refused(cfg, worker, tokenizer, monkeypatch):
    monkeypatch.setenv("PRORL_SERVERS", "http://127.0.0.1:1")
    with pytest.raises(Exception, match="truncation must be one of"):
        plugin.make_loop(cfg, tokenizer, truncation="keep")


def test_the_replay_buffer_reads_the_truncation_of_a_stored_row():
    from trainer_plugins.verl.replay_buffer import truncation_of

    assert truncation_of({"prorl": {"truncated": {"prompt": 0, "response": 3}}}) == {"prompt": 0, "response": 3}
    assert truncation_of({"prorl": {"truncated": None}}) is None and truncation_of({}) is None
