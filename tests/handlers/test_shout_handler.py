"""The ``shout`` handler (handlers/shout): two model turns with the environment's feedback between them; the
reward is the share of capital letters in the last turn.

Fast tier: a real rollout server (the project's app on loopback) whose LLM backend is the scripted policy of
tests/conftest.py (a test double for a capable model, speaking vLLM's token-in/token-out dialect with the tiny
model's real tokenizer). Real tier: the session's vLLM CPU server with the tiny random model.
"""
from __future__ import annotations

import pytest

from prorl_server.plugin.registry import HandlerRegistry
from handlers.shout import ShoutHandler, capital_share, load_dataset
from handlers.shout.handler import DEFAULT_FEEDBACK
from prorl_server.app import create_app
from prorl_server.config import ServerSettings


@pytest.fixture
def shout_server(aiohttp_client):
    async def make(backend: str):
        registry = HandlerRegistry()
        registry.register(ShoutHandler)
        app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry)
        return await aiohttp_client(app)

    return make


async def run(client, instance, max_tokens=32):
    r = await client.post("/process", json={"instance": instance, "sampling_params": {"max_tokens": max_tokens}})
    assert r.status == 200, await r.text()
    return await r.json()


@pytest.mark.parametrize("last, reward, resolved", [("SHIP AHOY", 1.0, True), ("Hello", 0.2, False),
                                                    ("1234 !!", 0.0, False), ("", 0.0, False)])
async def test_the_reward_is_the_share_of_capitals_in_the_last_turn_only(shout_server, scripted_policy, tokenizer,
                                                                         last, reward, resolved):
    seen = []

    def script(prompt, turn):
        seen.append(prompt)
        return "calm waters today" if turn == 0 else last  # turn 1's lower case must not count

    client = await shout_server(await scripted_policy(script))
    result = await run(client, {"data_source": "shout", "prompt": "Say something about the sea."})
    assert result["reward"] == pytest.approx(reward) and result["resolved"] is resolved
    assert result["filter"] is False and result["critical_error"] is None
    assert DEFAULT_FEEDBACK in seen[1] and DEFAULT_FEEDBACK not in seen[0]  # the model saw the feedback


async def test_the_feedback_is_environment_tokens_outside_the_loss(shout_server, scripted_policy, tokenizer):
    client = await shout_server(await scripted_policy(lambda prompt, turn: ["quiet", "LOUD"][turn]))
    result = await run(client, {"data_source": "shout", "prompt": "Say something.", "feedback": "Again, louder."})
    (t,) = result["trajectories"]
    assert t["num_turns"] == 2
    assert result["token_stats"]["turns"] == 2 and result["token_stats"]["splits"] == {}  # the drift report
    (turn1_ids, _), (turn2_ids, _) = scripted_policy.returned
    mask, ids = t["loss_mask"], t["response_ids"]
    n1, n2 = len(turn1_ids), len(turn2_ids)
    assert ids[:n1] == turn1_ids and ids[-n2:] == turn2_ids  # the generated tokens, as generated
    assert mask[:n1] == [1] * n1 and mask[-n2:] == [1] * n2
    env = ids[n1:-n2]
    assert env and mask[n1:-n2] == [0] * len(env)
    assert "Again, louder." in tokenizer.decode(env)
    assert t["response_logprobs"][n1:-n2] == [0.0] * len(env)


@pytest.mark.parametrize("instance, field", [({"prompt": ""}, "prompt"), ({"prompt": "hi", "turns": 1}, "turns"),
                                             ({}, "prompt"), ({"prompt": "hi", "feedback": 3}, "feedback")])
async def test_a_malformed_instance_is_refused_at_submit_naming_the_field(shout_server, scripted_policy,
                                                                          instance, field):
    asked = []
    client = await shout_server(await scripted_policy(lambda prompt, turn: asked.append(prompt) or "X"))
    r = await client.post("/process", json={"instance": {"data_source": "shout", **instance}})
    err = (await r.json())["error"]
    assert r.status == 422 and err["type"] == "validation_error" and err["field"] == f"instance.{field}", err
    assert err["message"].startswith(f"instance.{field}: ") and not asked  # never run


def test_capital_share_counts_cased_letters_only():
    assert capital_share("ABC def") == (0.5, 6)
    assert capital_share("ÉTÉ!") == (1.0, 3)
    assert capital_share("12 + 3 = 15") == (0.0, 0)


def test_the_dataset_is_seeded_and_every_prompt_distinct():
    a, b = load_dataset(limit=16, seed=1), load_dataset(limit=16, seed=1)
    assert a == b and len({x["prompt"] for x in a}) == 16
    assert all(x["data_source"] == "shout" and x["turns"] == 2 for x in a)


@pytest.mark.real
async def test_a_random_tiny_model_plays_two_turns_on_vllm(shout_server, vllm_server):
    client = await shout_server(vllm_server.address)
    rewards = []
    for inst in load_dataset(limit=4):
        result = await run(client, inst, max_tokens=8)
        (t,) = result["trajectories"]
        assert t["num_turns"] == 2 and sum(t["loss_mask"]) <= 16 and 0 in t["loss_mask"]
        assert result["filter"] is False and 0.0 <= result["reward"] <= 1.0
        rewards.append(result["reward"])
    assert any(0.0 < r < 1.0 for r in rewards)  # the random model mixes capitals and lower case


async def test_a_timeout_in_the_second_turn_keeps_the_first_turn_it_scores(aiohttp_client, tiny_model_dir):
    """Red team R10: ``timeout_s`` 2 after a 1.5 s first turn ended ``model_timeout``, scored (``filter: false``),
    with no trajectory, message or turn: a scored failure must keep what the model did. The backend is
    :class:`prorl_server.dev.fake_vllm.FakeVLLM` (it stands for vLLM's completions API; 0.1 s a token, so a
    15-token turn takes 1.5 s)."""
    from prorl_server.dev.fake_vllm import start_fake_vllm
    from prorl_server.types import JobResult

    fake, runner, addr = await start_fake_vllm(step_s=0.1, model=str(tiny_model_dir))
    try:
        registry = HandlerRegistry()
        registry.register(ShoutHandler)
        app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[addr],
                                        sandbox_runtime="none"), registry=registry)
        client = await aiohttp_client(app)
        inst = {"data_source": "shout", "prompt": "Say hi."}
        # a first job loads the tokenizer (seconds on a loaded machine), which the timed job must not wait for
        r = await client.post("/process", json={"instance": inst, "sampling_params": {"max_tokens": 1}})
        assert (await r.json())["failure_kind"] is None
        r = await client.post("/process", json={"instance": inst, "sampling_params": {"max_tokens": 15},
                                                "timeout_s": 2.0})
        res = JobResult(**await r.json())
    finally:
        await runner.cleanup()
    assert (res.critical_error, res.failure_kind, res.filter) == ("timeout", "model_timeout", False)
    assert res.reward == 0.0
    (traj,) = res.trajectories
    assert sum(traj.loss_mask) == 15 and traj.num_turns == 1  # the first turn's 15 sampled tokens, kept
    assert [m["role"] for m in res.messages][-2:] == ["assistant", "user"]  # its turn and the feedback after it
    (turn,) = res.turns
    assert turn.response_end - turn.response_start == 15 and turn.t_llm_s >= 1.4
