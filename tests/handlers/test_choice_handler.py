"""The ``choice`` handler (handlers/choice.py): multiple choice whose reply ends at the first option digit;
reward 1 when that option is the key.

Fast tier: a real rollout server (the project's app on loopback) whose LLM backend is the scripted policy of
tests/conftest.py (a test double for a capable model, vLLM's token-in/token-out dialect with the tiny model's
real tokenizer), or, to see the request the handler sends, a recording double of the same dialect below.
"""
from __future__ import annotations

import pytest

from handlers.choice import CATEGORIES, OPTIONS, ChoiceHandler, first_option, load_dataset, stop_strings
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin.registry import HandlerRegistry


@pytest.fixture
def choice_server(aiohttp_client):
    async def make(backend: str):
        registry = HandlerRegistry()
        registry.register(ChoiceHandler)
        app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry)
        return await aiohttp_client(app)

    return make


async def run(client, instance, **sampling):
    r = await client.post("/process", json={"instance": instance,
                                            "sampling_params": {"max_tokens": 32, **sampling}})
    assert r.status == 200, await r.text()
    return await r.json()


INSTANCE = {"data_source": "choice", "prompt": "Which of these is a fruit?\n1) red\n2) pear\n3) saw\n4) gold\n"
                                               "Answer with the number only.", "answer": "2"}


@pytest.mark.parametrize("reply, reward", [("2", 1.0), ("the answer: 2", 1.0), ("1", 0.0), ("4", 0.0),
                                           ("1234", 0.0), ("two) pear", 0.0), ("", 0.0), ("pear", 0.0)])
async def test_the_reward_is_whether_the_first_option_number_is_the_key(choice_server, scripted_policy, reply,
                                                                        reward):
    client = await choice_server(await scripted_policy(lambda prompt, turn: reply))
    result = await run(client, INSTANCE)
    assert result["reward"] == reward and result["resolved"] is (reward == 1.0)
    assert result["reward_components"]["outcome"]["value"] == reward
    assert result["filter"] is False and result["critical_error"] is None
    (turn,) = result["turns"]
    assert turn["t_llm_s"] >= 0.0  # the model time the completion-time reward is computed from


async def test_a_constant_answer_scores_a_quarter_of_the_dataset(choice_server, scripted_policy):
    client = await choice_server(await scripted_policy(lambda prompt, turn: "3"))
    rewards = [(await run(client, inst))["reward"] for inst in load_dataset(limit=16)]
    assert sum(rewards) == 4.0  # balanced keys: a constant (or always-first) answer is no policy


async def test_the_request_stops_at_an_option_number_beside_the_requests_own_stop(choice_server, aiohttp_server,
                                                                                  tokenizer, tiny_model_dir):
    """The recording double stands for vLLM: it answers one reply and keeps each request body."""
    from aiohttp import web

    bodies = []
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def models(request):
        return web.json_response({"data": [{"id": str(tiny_model_dir), "max_model_len": 16384}]})

    async def health(request):
        return web.Response()

    async def completions(request):
        bodies.append(await request.json())
        ids = tokenizer.encode("2", add_special_tokens=False) + [end_id]
        return web.json_response({"choices": [{
            "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": "stop",
            "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)}}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    backend = await aiohttp_server(app)
    client = await choice_server(str(backend.make_url("")).rstrip("/"))
    result = await run(client, INSTANCE, stop=["\n\n"], max_tokens=24)
    assert result["reward"] == 1.0
    (body,) = bodies
    assert body["stop"] == ["\n\n", "1", "2", "3", "4"] and body["max_tokens"] == 24


@pytest.mark.parametrize("instance, field", [({"prompt": "q", "answer": "5"}, "answer"),
                                             ({"prompt": "q", "answer": "A"}, "answer"),
                                             ({"answer": "1"}, "prompt"), ({"prompt": "", "answer": "1"}, "prompt")])
async def test_a_malformed_instance_is_refused_at_submit_naming_the_field(choice_server, scripted_policy,
                                                                          instance, field):
    asked = []
    client = await choice_server(await scripted_policy(lambda prompt, turn: asked.append(prompt) or "1"))
    r = await client.post("/process", json={"instance": {"data_source": "choice", **instance}})
    err = (await r.json())["error"]
    assert r.status == 422 and err["field"] == f"instance.{field}", err
    assert not asked  # never run


def test_first_option_and_stop_strings():
    assert first_option("xyz, 0 then 3 and 1") == "3" and first_option("one 5 9") is None
    assert stop_strings(None) == list(OPTIONS) and stop_strings("1") == list(OPTIONS)
    assert stop_strings(["\n"]) == ["\n", *OPTIONS]


def test_the_dataset_is_seeded_balanced_and_has_one_right_option():
    a, b = load_dataset(limit=16, seed=1), load_dataset(limit=16, seed=1)
    assert a == b and len({x["prompt"] for x in a}) == 16
    assert sorted(x["answer"] for x in a) == sorted(OPTIONS * 4)
    for x in a:
        cat = x["prompt"].split("Which of these is a ")[1].split("?")[0]
        options = {line[0]: line[3:] for line in x["prompt"].splitlines()[1:5]}
        right = [c for c, o in options.items() if o in CATEGORIES[cat]]
        assert right == [x["answer"]]


@pytest.mark.real
async def test_on_vllm_a_random_tiny_model_stops_at_its_first_option_number(choice_server, vllm_server, tokenizer):
    client = await choice_server(vllm_server.address)
    stopped = 0
    for inst in load_dataset(limit=8):
        result = await run(client, inst, max_tokens=128)
        (t,) = result["trajectories"]
        (turn,) = result["turns"]
        ids = t["response_ids"]
        assert result["filter"] is False and len(ids) == sum(t["loss_mask"]) <= 128
        # only the last sampled token holds an option digit: vLLM stopped on it and kept it in the tokens
        assert all(first_option(tokenizer.decode([i])) is None for i in ids[:-1])
        if first_option(tokenizer.decode(ids[-1:])):
            stopped += 1
            assert turn["finish_reason"] == "stop"
            assert result["resolved"] is (first_option(tokenizer.decode(ids)) == inst["answer"])
        else:  # 128 tokens without a digit (or the model's own end-of-turn token): no answer
            assert result["reward"] == 0.0 and not result["resolved"]
    assert stopped >= 6  # 2.3% of the tiny model's tokens hold an option digit: 128 tokens pass one by 95%
