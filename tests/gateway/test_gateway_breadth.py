"""The parameters agent SDKs send beyond plain chat, without vLLM: each one accepted by the gateway and reaching
the backend request in vLLM's form (``structured_outputs``, ``logit_bias``, ``logprobs=k``, the chat template's
variables), ``n > 1`` choices recorded as branches of the session, ``top_logprobs`` answered in the OpenAI
shape, vLLM's ``stop_reason`` carried to the Anthropic ``stop_sequence``. What vLLM does with them (constrained
generation, exact tokens) is tested on a real vLLM server in test_gateway_breadth_vllm.py.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
from aiohttp import web

from prorl_server.gateway import GATEWAY
from prorl_server.gateway.protocol import JSON_MAX_WHITESPACE
from prorl_server.types import Trajectory

AUTH = {"Authorization": "Bearer server-secret"}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}},
         {"type": "function", "function": {"name": "list", "description": "List files."}}]
START = [{"role": "system", "content": "You read files."}, {"role": "user", "content": "What is in a.txt?"}]
#: A chat template that shows the two variables the gateway may pass to it.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
            "{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}{% endif %}")


@pytest.fixture
def recording_vllm(aiohttp_server, tokenizer, tiny_model_dir, tmp_path):
    """A labelled TEST DOUBLE standing in for vLLM's ``/v1/completions`` (token-in/token-out dialect), for
    parameter plumbing only: it records every request body (``.bodies``) and answers ``text(body)`` tokenized
    with the tiny model's real tokenizer, ended with ``<|im_end|>`` (or, when the body has ``stop``, ended by
    its first string: ``stop_reason`` names it, as vLLM does), with ``top_logprobs`` in vLLM's
    ``token_id:N`` form when ``logprobs`` > 0. ``.returned``: ``(token_ids, logprobs)`` per answer.

    ``async (text, template=None, end="<|im_end|>") -> base URL``; ``template``: the served model's chat
    template (a copy of the tiny model's tokenizer with it), default the tiny model's own; ``end``: the stop
    token (another than ``<|im_end|>`` is reported as vLLM reports a generation-config stop token: its id in
    ``stop_reason``)."""
    async def start(text, template=None, end="<|im_end|>") -> str:
        end_id = tokenizer.convert_tokens_to_ids(end)
        model = str(tiny_model_dir)
        if template is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tiny_model_dir)
            tok.chat_template = template
            tok.save_pretrained(tmp_path / "tok")
            model = str(tmp_path / "tok")

        async def models(request):
            return web.json_response({"data": [{"id": model, "max_model_len": 4096}]})

        async def completions(request):
            body = await request.json()
            start.bodies.append(body)
            ids = tokenizer.encode(text(body), add_special_tokens=False)
            stop_reason = None
            if body.get("stop"):
                stop_reason = body["stop"][0]
            else:
                ids = ids + [end_id]
                stop_reason = None if end == "<|im_end|>" else end_id
            lps = [-0.5 - 0.01 * k for k in range(len(ids))]
            start.returned.append((ids, lps))
            logprobs = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": lps}
            k = body.get("logprobs") or 0
            if k:
                logprobs["top_logprobs"] = [{f"token_id:{t + j}": lp - j for j in range(k + 1)}
                                            for t, lp in zip(ids, lps)]
            return web.json_response({"choices": [{"text": tokenizer.decode(ids), "token_ids": ids,
                                                   "finish_reason": "stop", "stop_reason": stop_reason,
                                                   "logprobs": logprobs}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        async def health(request):
            return web.Response()

        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    start.bodies = []
    start.returned = []
    return start


async def finalize(client, session_id):
    r = await client.post(f"/sessions/{session_id}/finalize", headers=AUTH)
    assert r.status == 200, await r.text()
    return await r.json()


def structural_tag_schema(body):
    """The JSON schema inside the hermes structural tag the gateway sent, and the text around it."""
    tag = json.loads(body["structured_outputs"]["structural_tag"])
    before, schema, after = tag["format"]["elements"]
    assert schema["max_whitespace_cnt"] == JSON_MAX_WHITESPACE
    return before["value"], schema["json_schema"], after["value"]


def structural_tag_json(body):
    """The schema of the structural tag of one JSON value the gateway sent (None: no constraint)."""
    if "structured_outputs" not in body:
        return None
    fmt = json.loads(body["structured_outputs"]["structural_tag"])["format"]
    assert fmt["type"] == "json_schema" and fmt["max_whitespace_cnt"] == JSON_MAX_WHITESPACE
    return fmt["json_schema"]


async def test_forced_tool_calls_become_a_structural_tag_of_the_hermes_call_format(
        gateway_server, open_session, recording_vllm):
    backend = await recording_vllm(lambda b: '<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>')
    client, app = await gateway_server([backend])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "read"
    before, schema, after = structural_tag_schema(recording_vllm.bodies[-1])
    assert (before, after) == ("<tool_call>\n", "\n</tool_call>")
    assert [o["properties"]["name"] for o in schema["anyOf"]] == [{"const": "read"}, {"const": "list"}]
    assert schema["anyOf"][0]["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters given

    named = {"type": "function", "function": {"name": "list"}}
    await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS, tool_choice=named)
    _, schema, _ = structural_tag_schema(recording_vllm.bodies[-1])
    assert schema["properties"]["name"] == {"const": "list"} and schema["required"] == ["name", "arguments"]
    # auto and none constrain nothing
    for choice in ("auto", "none"):
        await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS, tool_choice=choice)
        assert "structured_outputs" not in recording_vllm.bodies[-1]


async def test_a_parser_without_a_constrainable_format_refuses_forced_calls_with_a_400(
        gateway_server, open_session, recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: "ok")])

    class Pythonic:
        """Stands for a parser whose call format the gateway has no constraint for (only its name matters)."""

        name = "pythonic"

        def parse(self, text):
            raise AssertionError("never reached: the request is refused first")

    app[GATEWAY].engine.parser = Pythonic()
    s, sdk = await open_session(client)
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS, tool_choice="required")
    assert e.value.code == "unsupported_parameter" and e.value.param == "tool_choice"
    assert "hermes" in e.value.message and "pythonic" in e.value.message
    assert recording_vllm.bodies == []
    status = await (await client.get(f"/sessions/{s['session_id']}", headers=AUTH)).json()
    assert status["num_trajectories"] == 0


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
        "n": {"type": "integer"}}}}}, {"type": "object", "properties": {"n": {"type": "integer"}}}),
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "text"}, None),
])
async def test_response_format_becomes_vllm_structured_outputs(fmt, expected, gateway_server, open_session,
                                                                recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: '{"n": 1}')])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, response_format=fmt)
    assert r.choices[0].message.content == '{"n": 1}'
    assert structural_tag_json(recording_vllm.bodies[-1]) == expected


async def test_logit_bias_and_top_logprobs_reach_vllm_and_come_back_in_the_openai_shape(
        gateway_server, open_session, recording_vllm, tokenizer):
    client, app = await gateway_server([await recording_vllm(lambda b: "hello there")])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, logit_bias={"7": -100, "42": 2.5},
                                          logprobs=True, top_logprobs=2)
    body = recording_vllm.bodies[-1]
    assert body["logit_bias"] == {"7": -100.0, "42": 2.5} and body["logprobs"] == 2
    ids, lps = recording_vllm.returned[-1]
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == lps
    for c, t, lp in zip(content, ids, lps):
        # the backend offered 3 alternatives (top 2 + the sampled one): the 2 most likely, most likely first
        assert [a.token for a in c.top_logprobs] == tokenizer.convert_ids_to_tokens([t, t + 1])
        assert [a.logprob for a in c.top_logprobs] == [lp, lp - 1]
    r = await sdk.chat.completions.create(model="m", messages=START, logprobs=True)
    assert recording_vllm.bodies[-1]["logprobs"] == 0 and "logit_bias" not in recording_vllm.bodies[-1]
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)


async def test_reasoning_effort_and_chat_template_kwargs_reach_the_template_and_a_change_splits(
        gateway_server, open_session, recording_vllm, tokenizer):
    client, app = await gateway_server([await recording_vllm(lambda b: "ok", template=TEMPLATE)])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, reasoning_effort="low",
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = tokenizer.decode(recording_vllm.bodies[-1]["prompt"])
    assert prompt.endswith("<|im_start|>assistant\n[effort=low][thinking=False]")
    messages = START + [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": "again"}]
    await sdk.chat.completions.create(model="m", messages=messages, reasoning_effort="high")
    assert tokenizer.decode(recording_vllm.bodies[-1]["prompt"]).endswith("assistant\n[effort=high]")
    result = await finalize(client, s["session_id"])
    assert [t["split_reason"].split(":")[0] for t in result["trajectories"][:-1]] == ["chat_template_kwargs_changed"]


async def test_n_choices_are_branches_and_the_session_continues_with_the_one_sent_back(
        gateway_server, open_session, recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: f"answer {b.get('seed')}")])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == ["answer 7", "answer 8", "answer 9"]
    prompts = [b["prompt"] for b in recording_vllm.bodies]
    assert len(prompts) == 3 and prompts[0] == prompts[1] == prompts[2]
    returned = list(recording_vllm.returned)
    assert r.usage.completion_tokens == sum(len(ids) for ids, _ in returned)
    by_seed = {b["seed"]: ids for b, (ids, _) in zip(recording_vllm.bodies, returned)}
    # the agent goes on with choice 1
    messages = START + [r.choices[1].message, {"role": "user", "content": "and?"}]
    await sdk.chat.completions.create(model="m", messages=messages, seed=100)
    result = await finalize(client, s["session_id"])
    trajs = [Trajectory(**t) for t in result["trajectories"]]
    assert len(trajs) == 3 and result["split_reasons"] == []
    branches, main = trajs[:2], trajs[2]
    assert [t.split_reason for t in branches] == [
        "branch: choice 0 of 3, not continued (the agent went on with choice 1)",
        "branch: choice 2 of 3, not continued (the agent went on with choice 1)"]
    for t, seed in zip(branches, (7, 9)):
        assert t.prompt_ids == prompts[0] and t.response_ids == by_seed[seed] and t.num_turns == 1
        assert t.loss_mask == [1] * len(t.response_ids) and t.finish_reason == "stop"
    assert main.prompt_ids == prompts[0] and main.num_turns == 2 and main.split_reason is None
    assert main.response_ids[:len(by_seed[8])] == by_seed[8]
    # the second turn was generated after choice 1's tokens, and is the trajectory's last generated span
    second = recording_vllm.bodies[-1]["prompt"]
    assert second[:len(prompts[0]) + len(by_seed[8])] == prompts[0] + by_seed[8]
    assert main.prompt_ids + main.response_ids == second + recording_vllm.returned[-1][0]


async def test_n_choices_end_with_the_first_continued_when_the_agent_sends_none_of_them(
        gateway_server, open_session, recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: f"answer {b.get('seed')}")])
    s, sdk = await open_session(client)
    await sdk.chat.completions.create(model="m", messages=START, n=2, seed=1)
    result = await finalize(client, s["session_id"])
    trajs = [Trajectory(**t) for t in result["trajectories"]]
    assert [t.split_reason for t in trajs] == ["branch: choice 1 of 2, not continued (the agent went on with "
                                               "choice 0)", None]
    assert result["messages"][-1] == {"role": "assistant", "content": "answer 1"}


async def test_n_choices_stream_one_sequence_of_chunks_per_choice(gateway_server, open_session, recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: f"answer {b.get('seed')}")])
    s, sdk = await open_session(client)
    stream = await sdk.chat.completions.create(model="m", messages=START, n=2, seed=3, stream=True)
    text, finish = {0: "", 1: ""}, {}
    async for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {0: "answer 3", 1: "answer 4"} and finish == {0: "stop", 1: "stop"}


async def test_vllms_stop_reason_is_in_the_choice_and_the_anthropic_stop_sequence(
        gateway_server, open_session, recording_vllm):
    client, app = await gateway_server([await recording_vllm(lambda b: "partial answer")])
    s, sdk = await open_session(client)
    raw = await sdk.chat.completions.with_raw_response.create(model="m", messages=START, stop=["END"])
    assert json.loads(raw.text)["choices"][0]["stop_reason"] == "END"
    s2, _ = await open_session(client)
    async with anthropic.AsyncAnthropic(base_url=s2["base_url"].removesuffix("/v1"), api_key="x",
                                        max_retries=0) as claude:
        m = await claude.messages.create(model="m", max_tokens=32, stop_sequences=["END"],
                                         messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "END"


async def test_a_special_stop_token_is_kept_in_the_tokens_and_left_out_of_the_answer(
        gateway_server, open_session, recording_vllm, tokenizer):
    client, app = await gateway_server([await recording_vllm(lambda b: '{"a": 1}', end="<|endoftext|>")])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, response_format={"type": "json_object"})
    assert r.choices[0].message.content == '{"a": 1}'  # what a JSON client parses
    messages = START + [r.choices[0].message, {"role": "user", "content": "and?"}]
    await sdk.chat.completions.create(model="m", messages=messages)
    result = await finalize(client, s["session_id"])
    assert len(result["trajectories"]) == 1 and result["split_reasons"] == []  # the resent answer is the same
    traj = Trajectory(**result["trajectories"][0])
    first = recording_vllm.returned[0][0]
    assert first[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert traj.response_ids[:len(first)] == first


async def test_top_logprobs_without_logprobs_asks_nothing_more_of_vllm(gateway_server, open_session, recording_vllm):
    """The Responses route passes ``top_logprobs`` on without Chat's ``logprobs`` flag: accepted, nothing more
    is asked of the backend (its answers carry no logprobs)."""
    client, app = await gateway_server([await recording_vllm(lambda b: "ok")])
    s, sdk = await open_session(client)
    r = await sdk.responses.create(model="m", input="hi", top_logprobs=3, store=False)
    assert r.output_text == "ok" and recording_vllm.bodies[-1]["logprobs"] == 0
