"""The drift report and the per-family tool-call parser.

Every job result and every gateway session (summary and result) carries ``token_stats`` (turns, splits by
reason code, continued turns, re-rendered characters, model family); ``/metrics`` counts splits by reason and
family and turns by family. The ``auto`` parser setting (the default) reads each conversation's tool calls
with its model family's parser: ``hermes`` for ChatML, vLLM's ``llama3_json`` for a Llama 3 template, built
once per tokenizer in a worker thread.

Fast tier: a real rollout server on loopback whose backend is the scripted policy of tests/conftest.py (a
test double for a capable model in vLLM's token-in/token-out dialect, with the tiny model's real ChatML
tokenizer), real family tokenizers (the tiny models carrying each family's published template), and
:class:`ScriptedLlama` standing for a vLLM backend serving a Llama 3 model that writes the given texts.
Real tier: a Llama 3.1 family model served by vLLM CPU.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from prorl_server.llm.agent_loop import AgentConfig, AgentLoop
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.llm.conversation import Conversation
from prorl_server.llm.client import Completion, LLMClient, ModelInfo
from prorl_server.metrics import Metrics
from prorl_server.plugin import AgentHandler, HandlerRegistry
from prorl_server.plugin.toolkit import run_agent
from prorl_server.llm.tool_parser import HermesToolParser
from prorl_server.llm.turn import TurnEngine, parser_for, parser_name_for
from prorl_server.types import TokenStats

ROOT = Path(__file__).resolve().parents[2]
ECHO = {"type": "function", "function": {"name": "echo", "description": "Echo a text.",
                                         "parameters": {"type": "object",
                                                        "properties": {"text": {"type": "string"}}}}}


async def echo(args):
    return "echo " + str(args.get("text"))


class EchoAgent(AgentHandler):
    """A handler running the shared agent loop (``run_agent``) with one echo tool, ``conversations`` times
    in one job (a job with several conversations reports their summed drift)."""

    name = "echo_agent"

    async def run(self, job) -> None:
        for i in range(int(job.instance.get("conversations", 1))):
            await run_agent(job, [{"role": "system", "content": "You echo."},
                                  {"role": "user", "content": f"Echo {i}."}],
                            {"echo": (ECHO, echo)}, AgentConfig(max_turns=int(job.instance.get("max_turns", 4)),
                                                                stop_on_no_tool_call=False))

    async def eval(self, job) -> None:
        job.reward = 1.0


def hermes_call(text: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "echo", "arguments": {"text": text}})}\n</tool_call>'


def finish_call() -> str:
    return f'<tool_call>\n{json.dumps({"name": "finish", "arguments": {"answer": "done"}})}\n</tool_call>'


@pytest.fixture
def server(aiohttp_client):
    async def make(backend: str):
        registry = HandlerRegistry()
        registry.register(EchoAgent)
        app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry)
        return await aiohttp_client(app)

    return make


def samples(text: str, family: str) -> dict[tuple, float]:
    """Label values -> value of the counter ``family`` in a /metrics text (labels: ``prorl_turns``
    ``(family,)``, ``prorl_trajectory_splits`` ``(reason, family)``)."""
    keys = ("reason", "family")
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name == family:
            for s in f.samples:
                if s.name.endswith("_total"):
                    out[tuple(s.labels[k] for k in keys if k in s.labels)] = s.value
    return out


# ------------------------------------------------------------------------------------------ job results


async def test_a_job_result_carries_the_summed_drift_report_and_metrics_count_its_turns(server, scripted_policy):
    # each conversation: one echo call, then finish -> 2 generated turns, no split (ChatML renders verbatim)
    client = await server(await scripted_policy(lambda prompt, turn: hermes_call("hi") if turn == 0
                                                else finish_call()))
    r = await client.post("/process", json={"instance": {"data_source": "echo_agent", "conversations": 2}})
    assert r.status == 200, await r.text()
    result = await r.json()
    assert result["critical_error"] is None and len(result["trajectories"]) == 1  # the last conversation's
    assert result["token_stats"] == {"family": "chatml", "turns": 4, "splits": {}, "continued": 0,
                                     "rerendered_chars": 0}
    text = await (await client.get("/metrics")).text()
    assert samples(text, "prorl_turns") == {("chatml",): 4.0}
    assert samples(text, "prorl_trajectory_splits") == {}  # defined, nothing split


async def test_a_job_without_a_conversation_has_no_token_stats(aiohttp_client):
    from handlers.arithmetic import ArithmeticHandler

    registry = HandlerRegistry()
    registry.register(ArithmeticHandler)
    client = await aiohttp_client(create_app(ServerSettings(health_interval_s=3600), registry=registry))
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "1+1",
                                                         "answer": 2}})
    assert (await r.json())["token_stats"] is None


def test_token_stats_add_up_per_reason_and_keep_one_family():
    a = TokenStats(family="qwen3", turns=3, splits={"template_drops_generated_text": 1}, continued=2,
                   rerendered_chars=40)
    b = TokenStats(family="qwen3", turns=2, splits={"template_drops_generated_text": 2, "message_changed": 1})
    assert (a + b).model_dump() == {"family": "qwen3", "turns": 5, "splits": {"template_drops_generated_text": 3,
                                                                            "message_changed": 1},
                                    "continued": 2, "rerendered_chars": 40}
    assert (a + TokenStats()).family == "qwen3" and (a + TokenStats(family="llama3")).family == "mixed"


# ------------------------------------------------------------------------------------------ split counter


async def test_a_template_split_is_counted_with_its_reason_and_family(family_model_dir):
    # Qwen3's template drops the reasoning of turns before a new user message: a real split of a real template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_model_dir("qwen3"))
    conv = Conversation(tok, [{"role": "user", "content": "Think, then answer."}], max_context_tokens=4096)
    text = "<think>\nsome reasoning\n</think>\n\nThe answer."
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    conv.add_completion(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                   stop_reason=None, backend="http://scripted", weight_versions=[]))
    assert await conv.add_messages([{"role": "user", "content": "And again?"}])
    stats = TokenStats(**conv.token_stats())
    assert stats.splits == {"template_drops_generated_text": 1} and stats.family == "qwen3"

    m = Metrics()
    m.count_token_stats(stats)
    m.count_token_stats(stats)
    text = m.render().decode()
    assert samples(text, "prorl_trajectory_splits") == {("template_drops_generated_text", "qwen3"): 2.0}
    assert samples(text, "prorl_turns") == {("qwen3",): 2.0}


def test_label_values_stay_bounded():
    m = Metrics()
    m.count_token_stats(TokenStats(family="Weird Family!", turns=1, splits={"x" * 100: 1, "message_changed": 0}))
    text = m.render().decode()
    assert samples(text, "prorl_trajectory_splits") == {("other", "other"): 1.0}
    assert samples(text, "prorl_turns") == {("other",): 1.0}


# ------------------------------------------------------------------------------------------ gateway sessions


async def test_a_session_reports_its_drift_and_a_job_less_session_is_counted_when_it_ends(server, scripted_policy):
    client = await server(await scripted_policy(lambda prompt, turn: f"answer {turn}"))
    s = await (await client.post("/sessions", json={})).json()
    chat = f"{URL(s['base_url']).path}/chat/completions"
    start = [{"role": "user", "content": "Hi."}]
    r = await client.post(chat, json={"messages": start})
    first = (await r.json())["choices"][0]["message"]["content"]
    more = start + [{"role": "assistant", "content": first}, {"role": "user", "content": "More."}]
    assert (await client.post(chat, json={"messages": more})).status == 200  # extends the history: no split
    changed = start + [{"role": "assistant", "content": first + " "}, {"role": "user", "content": "Again."}]
    assert (await client.post(chat, json={"messages": changed})).status == 200  # a changed message: a split

    status = await (await client.get(f"/sessions/{s['session_id']}")).json()
    expected = {"family": "chatml", "turns": 3, "splits": {"message_changed": 1}, "continued": 0,
                "rerendered_chars": 0}
    assert status["token_stats"] == expected
    text = await (await client.get("/metrics")).text()
    assert samples(text, "prorl_turns") == {}  # counted when the session ends, not before

    result = await (await client.post(f"/sessions/{s['session_id']}/finalize")).json()
    assert result["token_stats"] == expected and len(result["trajectories"]) == 2
    text = await (await client.get("/metrics")).text()
    assert samples(text, "prorl_trajectory_splits") == {("message_changed", "chatml"): 1.0}
    assert samples(text, "prorl_turns") == {("chatml",): 3.0}
    await client.post(f"/sessions/{s['session_id']}/finalize")  # idempotent: counted once
    assert samples(await (await client.get("/metrics")).text(), "prorl_turns") == {("chatml",): 3.0}


class GatewayAgent(AgentHandler):
    """A handler whose agent talks to a gateway session bound to its job (as ``cli_agent``'s does): two
    requests, the second resending the first answer changed (a split)."""

    name = "gateway_agent"

    async def run(self, job) -> None:
        from prorl_server.gateway.protocol import parse_chat_request

        gw = job.services.gateway
        s = gw.create_session(job=job)
        start = [{"role": "user", "content": "Hi."}]
        answer, _ = await gw.chat(s, parse_chat_request({"messages": start}))
        first = answer["choices"][0]["message"]["content"]
        await gw.chat(s, parse_chat_request({"messages": start + [
            {"role": "assistant", "content": first + "!"}, {"role": "user", "content": "Again."}]}))
        gw.finalize(s)
        job.trajectories = s.trajectories()

    async def eval(self, job) -> None:
        job.reward = 1.0


async def test_a_jobs_gateway_session_reports_its_drift_in_the_job_result_counted_once(aiohttp_client,
                                                                                      scripted_policy):
    registry = HandlerRegistry()
    registry.register(GatewayAgent)
    backend = await scripted_policy(lambda prompt, turn: f"answer {turn}")
    client = await aiohttp_client(create_app(ServerSettings(backends=[backend], health_interval_s=3600),
                                             registry=registry))
    r = await client.post("/process", json={"instance": {"data_source": "gateway_agent"}})
    result = await r.json()
    assert r.status == 200 and result["critical_error"] is None, result
    assert result["token_stats"] == {"family": "chatml", "turns": 2, "splits": {"message_changed": 1},
                                     "continued": 0, "rerendered_chars": 0}
    text = await (await client.get("/metrics")).text()
    assert samples(text, "prorl_trajectory_splits") == {("message_changed", "chatml"): 1.0}  # with the job only
    assert samples(text, "prorl_turns") == {("chatml",): 2.0}


# ------------------------------------------------------------------------------------------ parser per family


def test_auto_names_the_familys_parser(tokenizer, family_model_dir):
    from transformers import AutoTokenizer

    assert parser_name_for("auto", tokenizer) == "hermes"  # the tiny model's ChatML (Qwen2.5) template
    names = {t: parser_name_for("auto", AutoTokenizer.from_pretrained(family_model_dir(t)))
             for t in ("llama3_1", "mistral_v7_tekken", "deepseekv3", "gemma3", "qwen3")}
    assert names == {"llama3_1": "llama3_json", "mistral_v7_tekken": "mistral", "deepseekv3": "deepseek_v3",
                     "gemma3": "hermes", "qwen3": "hermes"}
    assert parser_name_for("hermes", AutoTokenizer.from_pretrained(family_model_dir("llama3_1"))) == "hermes"
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        TurnEngine(LLMClient(), "nope")


async def test_a_vllm_parser_is_built_off_the_event_loop_once_per_tokenizer(family_model_dir, tokenizer,
                                                                            monkeypatch):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    import prorl_server.llm.turn as turn_mod

    built_in = []
    real_build = turn_mod._build

    def recording_build(name, tok):
        built_in.append((name, threading.current_thread() is threading.main_thread()))
        return real_build(name, tok)

    monkeypatch.setattr(turn_mod, "_build", recording_build)
    llama = AutoTokenizer.from_pretrained(family_model_dir("llama3_1"))
    p = await parser_for("auto", llama)
    assert p.name == "llama3_json" and built_in == [("llama3_json", False)]  # in a worker thread
    assert await parser_for("auto", llama) is p and len(built_in) == 1  # cached for this tokenizer
    assert await parser_for("llama3_json", llama) is p
    other = AutoTokenizer.from_pretrained(family_model_dir("llama3_1"))
    assert await parser_for("auto", other) is not p  # another tokenizer: its own parser
    assert isinstance(await parser_for("auto", tokenizer), HermesToolParser)  # hermes: inline, no vLLM


class ScriptedLlama(LLMClient):
    """Stands for a vLLM backend serving a Llama 3 model: each call returns the next text, tokenized with the
    Llama family tokenizer and ended with ``<|eot_id|>``."""

    def __init__(self, tok, texts):
        super().__init__()
        self.tok, self.texts = tok, list(texts)

    async def model_info(self, address, timeout_s=30.0):
        return ModelInfo(id="scripted-llama", max_model_len=4096)

    async def complete(self, prompt_ids, *, backend, max_tokens, sampling_params=None, timeout_s=None):
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        ids.append(self.tok.convert_tokens_to_ids("<|eot_id|>"))
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", stop_reason=None,
                          backend="http://scripted", weight_versions=[])


async def test_the_agent_loop_reads_a_llama_models_calls_with_llama3_json_by_default(family_model_dir):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_model_dir("llama3_1"))
    llm = ScriptedLlama(tok, ['{"name": "echo", "parameters": {"text": "hi"}}',
                              '{"name": "finish", "parameters": {"answer": "done"}}'])
    loop = AgentLoop(tok, llm, {"echo": (ECHO, echo)}, AgentConfig(max_turns=4))
    result = await loop.run([{"role": "user", "content": "Echo hi."}], backend="http://scripted")
    assert result.finish_reason == "stop" and result.answer == {"answer": "done"}
    assert result.metrics["tool_calls"] == 2 and result.metrics["malformed_tool_calls"] == 0
    assert result.messages[2]["content"] == "echo hi"  # the echo tool ran with the parsed arguments
    assert result.token_stats.family == "llama3" and result.token_stats.splits == {}
    assert result.token_stats.turns == 2


async def test_the_hermes_setting_still_reads_hermes_for_any_family(family_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_model_dir("llama3_1"))
    llm = ScriptedLlama(tok, [hermes_call("x"), finish_call()])
    loop = AgentLoop(tok, llm, {"echo": (ECHO, echo)}, AgentConfig(max_turns=4, parser="hermes"))
    result = await loop.run([{"role": "user", "content": "Echo x."}], backend="http://scripted")
    assert result.finish_reason == "stop" and result.metrics["tool_calls"] == 2


# ------------------------------------------------------------------------------------------ real tier


@pytest.mark.real
async def test_a_llama_family_rollout_on_vllm_has_no_split_in_its_result_and_on_metrics(family_model_dir,
                                                                                       aiohttp_client, monkeypatch):
    """A Llama 3.1 family model served by vLLM CPU runs the agent loop (the echo tool offered, the ``auto``
    parser: vLLM's llama3_json) through ``/process``: the result's drift report shows every turn and no split,
    and ``/metrics`` counts the turns under the family."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    import weakref

    import prorl_server.llm.turn as turn_mod
    from prorl_server.dev.vllm_launcher import start_vllm

    monkeypatch.setattr(turn_mod, "_PARSERS_BY_TOKENIZER", weakref.WeakKeyDictionary())  # this test's builds only
    model_dir = family_model_dir("llama3_1")
    tok = AutoTokenizer.from_pretrained(model_dir)
    # The random model writes 20 ordinary tokens and its end of turn only (a template marker mid-turn is noise):
    # each turn ends by itself well within 200 tokens (a turn cut by max_tokens without a call ends the loop).
    added = set(tok.get_added_vocab().values())
    allowed = [i for i in range(len(tok)) if i not in added][200:220] + [tok.convert_tokens_to_ids("<|eot_id|>")]
    vllm = start_vllm(model_dir, max_model_len=2048, max_num_batched_tokens=2048, timeout_s=300,
                      log_path=ROOT / ".cache" / "logs" / f"vllm-drift-llama3_1-{os.getpid()}.log")
    try:
        registry = HandlerRegistry()
        registry.register(EchoAgent)
        app = create_app(ServerSettings(backends=[vllm.address], health_interval_s=3600), registry=registry)
        client = await aiohttp_client(app)
        t0 = time.monotonic()
        r = await client.post("/process", json={
            "instance": {"data_source": "echo_agent", "max_turns": 4},
            "sampling_params": {"max_tokens": 200, "temperature": 1.0, "seed": 7, "allowed_token_ids": allowed}})
        result = await r.json()
        assert r.status == 200 and result["critical_error"] is None, result
        (traj,) = result["trajectories"]
        stats = result["token_stats"]
        print(f"\ndrift llama3_1 {stats} rollout_s={time.monotonic() - t0:.1f}")
        assert stats["family"] == "llama3" and stats["splits"] == {} and stats["turns"] == traj["num_turns"] == 4
        # the turns were read by vLLM's llama3_json parser, built for the served tokenizer
        assert [sorted(d) for d in turn_mod._PARSERS_BY_TOKENIZER.values()] == [["llama3_json"]]
        text = await (await client.get("/metrics")).text()
        assert samples(text, "prorl_turns") == {("llama3",): 4.0}
        assert samples(text, "prorl_trajectory_splits") == {}
    finally:
        vllm.stop()
