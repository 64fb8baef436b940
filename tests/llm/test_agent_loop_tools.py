"""Agent-loop stop conditions and tool failures, with a scripted LLM standing for a vLLM backend that
generates the given texts (the real-server behaviour is covered in test_vllm_rollouts.py). Tools that raise
stand in for sandbox tools hitting the errors of :mod:`sandbox.errors` (the same classes the host client
raises); what becomes an observation and what fails the rollout is the rule under test."""
from __future__ import annotations

import asyncio

import pytest

from prorl_server.llm.agent_loop import AgentConfig, AgentLoop, tool_schema
from prorl_server.balancer import Backend
from prorl_server.failures import InfrastructureError
from prorl_server.llm.client import Completion, LLMClient, ModelInfo
from sandbox.errors import (EditorError, KernelDiedError, ProtocolError, SandboxDeadError, SandboxStartError,
                            ToolTimeout)


class ScriptedLLM(LLMClient):
    """Stands for vLLM: each call returns the next scripted text (tokenized, then <|im_end|>)."""

    def __init__(self, tokenizer, texts, max_model_len=4096):
        super().__init__()
        self.tok, self.texts, self.prompts = tokenizer, list(texts), []
        self.max_model_len = max_model_len

    async def model_info(self, address, timeout_s=30.0):
        return ModelInfo(id="scripted", max_model_len=self.max_model_len)

    async def complete(self, prompt_ids, *, backend, max_tokens, sampling_params=None, timeout_s=None):
        self.prompts.append(list(prompt_ids))
        text = self.texts.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)[:max_tokens]
        cut = len(ids) == max_tokens
        if not cut:
            ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="length" if cut else "stop",
                          stop_reason=None, backend="http://scripted", weight_versions=[5])


def call(name, **args):
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


async def echo(args):
    return "echo " + args["text"]


async def boom(args):
    raise ValueError("disk full")


async def slow(args):
    await asyncio.sleep(10)
    return "late"


async def refused(args):  # what the editor client raises for a str_replace whose old_str is not unique
    raise EditorError("old_str 'x' is not unique in /workspace/a.py (2 occurrences)")


async def kernel_killed(args):  # the model's own code killed the IPython kernel
    raise KernelDiedError("the kernel died while running the cell; a fresh one starts on the next call")


async def own_timeout(args):  # a tool fn of the handler that times out inside, on its own
    raise asyncio.TimeoutError("the tool's own wait")


def raising(exc):
    async def fn(args):
        raise exc
    return fn


TOOLS = {"echo": ({"type": "object", "properties": {"text": {"type": "string"}}}, echo),
         "boom": ({"description": "fails", "type": "object", "properties": {}}, boom),
         "slow": ({"type": "object", "properties": {}}, slow),
         "refused": ({"type": "object", "properties": {}}, refused),
         "kernel_killed": ({"type": "object", "properties": {}}, kernel_killed),
         "own_timeout": ({"type": "object", "properties": {}}, own_timeout)}
START = [{"role": "user", "content": "Do the task."}]


async def run(tokenizer, texts, **cfg):
    llm = ScriptedLLM(tokenizer, texts)
    loop = AgentLoop(tokenizer, llm, TOOLS, AgentConfig(**{"tool_timeout_s": 0.2, **cfg}))
    return await loop.run(START, backend=Backend("http://scripted")), llm, loop


async def test_finish_tool_ends_the_rollout_with_its_answer(tokenizer):
    r, llm, _ = await run(tokenizer, ["hi " + call("echo", text="a"), call("finish", answer="42")])
    assert r.finish_reason == "stop" and r.answer == {"answer": "42"} and r.num_turns == 2
    tool_msgs = [m for m in r.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["echo a"]
    assert r.messages[1]["tool_calls"][0]["function"]["name"] == "echo"
    assert r.weight_versions == [5]


async def test_model_caused_tool_errors_become_observations(tokenizer):
    bad = '<tool_call>{"name": "echo", "arguments": {"text": </tool_call>'
    turn = (bad + call("nope") + call("boom") + call("refused") + call("kernel_killed") + call("own_timeout")
            + call("echo", text="still runs"))
    r, llm, loop = await run(tokenizer, [turn, "no more tools"])
    obs = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert obs[0].startswith("Error: tool call is not valid JSON")
    assert obs[1].startswith("Error: unknown tool 'nope'")
    assert obs[2] == "Error: tool 'boom' failed: ValueError: disk full"
    assert obs[3].startswith("Error: tool 'refused' failed: EditorError: old_str 'x' is not unique")
    assert obs[4].startswith("Error: tool 'kernel_killed' failed: KernelDiedError: the kernel died")
    assert obs[5].startswith("Error: tool 'own_timeout' failed: TimeoutError")
    assert obs[6] == "echo still runs"
    m = r.metrics
    assert (m["malformed_tool_calls"], m["unknown_tool_calls"], m["tool_errors"], m["tool_timeouts"]) == (1, 1, 4, 0)
    assert m["tool_calls"] == 6
    assert r.finish_reason == "no_tool_call" and r.num_turns == 2
    # the second turn was generated from the first turn's tokens plus the observations
    (traj,) = r.trajectories
    assert llm.prompts[1] == (traj.prompt_ids + traj.response_ids)[:len(llm.prompts[1])]


@pytest.mark.parametrize("exc", [SandboxDeadError("sandbox sb-1: its processes are gone while running bash"),
                                 SandboxStartError("sandbox sb-1 did not become ready"),
                                 ProtocolError("sandbox sb-1: invalid response"),
                                 ToolTimeout("sandbox sb-1: no answer to bash within the timeout plus 10 s"),
                                 InfrastructureError("harness", "the tool's service is down")],
                         ids=lambda e: type(e).__name__)
async def test_infrastructure_errors_of_a_tool_fail_the_rollout_not_the_model(tokenizer, exc):
    llm = ScriptedLLM(tokenizer, [call("echo", text="a") + call("infra") + call("echo", text="never"),
                                  "unreachable"])
    ran = []

    async def echo_and_record(args):
        ran.append(args["text"])
        return "ok"

    tools = {"echo": (TOOLS["echo"][0], echo_and_record), "infra": ({"type": "object"}, raising(exc))}
    loop = AgentLoop(tokenizer, llm, tools, AgentConfig(tool_timeout_s=5))
    with pytest.raises(type(exc)) as info:
        await loop.run(START, backend=Backend("http://scripted"))
    assert info.value is exc
    assert ran == ["a"] and len(llm.texts) == 1  # nothing after the fault ran, no turn was generated on it


async def test_a_tool_that_does_not_answer_within_tool_timeout_s_fails_the_rollout(tokenizer):
    llm = ScriptedLLM(tokenizer, [call("slow"), "unreachable"])
    loop = AgentLoop(tokenizer, llm, TOOLS, AgentConfig(tool_timeout_s=0.2))
    with pytest.raises(ToolTimeout, match="'slow' gave no answer within 0.2 s"):
        await loop.run(START, backend=Backend("http://scripted"))
    assert len(llm.texts) == 1


async def test_a_tool_with_its_own_time_limit_is_not_cut_by_tool_timeout_s(tokenizer):
    async def limited(args):  # like sandbox_tools' bash: reports a slow command as output, by itself
        await asyncio.sleep(0.3)
        return "partial output\n[timed out]"

    limited.timeout_s = 0.25
    llm = ScriptedLLM(tokenizer, [call("limited"), "done"])
    loop = AgentLoop(tokenizer, llm, {"limited": ({"type": "object"}, limited)}, AgentConfig(tool_timeout_s=0.1))
    r = await loop.run(START, backend=Backend("http://scripted"))
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == ["partial output\n[timed out]"]
    assert r.metrics["tool_timeouts"] == 0


async def test_max_turns_stops_before_running_the_last_turns_tools(tokenizer):
    ran = []

    async def record(args):
        ran.append(args["i"])
        return "ok"

    llm = ScriptedLLM(tokenizer, [call("rec", i=i) for i in range(5)])
    loop = AgentLoop(tokenizer, llm, {"rec": ({"type": "object"}, record)}, AgentConfig(max_turns=3))
    r = await loop.run(START, backend="http://scripted")
    assert r.finish_reason == "max_turns" and r.num_turns == 3 and ran == [0, 1]
    assert r.messages[-1]["role"] == "assistant"
    assert r.trajectories[0].loss_mask[-1] == 1


async def test_without_stop_on_no_tool_call_the_model_is_nudged(tokenizer):
    r, _, _ = await run(tokenizer, ["thinking...", call("finish", answer="x")], stop_on_no_tool_call=False)
    assert r.finish_reason == "stop"
    assert r.messages[2] == {"role": "user", "content": AgentConfig().no_tool_call_message}


async def test_context_limit_ends_with_length_and_never_overflows(tokenizer):
    long_turn = call("echo", text="z" * 40)
    r, llm, _ = await run(tokenizer, [long_turn] * 50, max_context_tokens=600, max_turns=50)
    assert r.finish_reason == "length"
    (traj,) = r.trajectories
    assert len(traj.prompt_ids) + len(traj.response_ids) <= 600
    assert all(len(p) < 600 for p in llm.prompts)


async def test_turn_cut_by_max_tokens_without_a_call_is_length(tokenizer):
    r, _, _ = await run(tokenizer, ["word " * 100], max_tokens_per_turn=8)
    assert r.finish_reason == "length" and r.trajectories[0].finish_reason == "length"


def test_tool_schemas_are_normalised():
    assert tool_schema("f", {"type": "object"})["function"] == {"name": "f", "description": "",
                                                               "parameters": {"type": "object"}}
    fn = {"name": "g", "description": "d", "parameters": {}}
    assert tool_schema("g", fn) == {"type": "function", "function": fn}
    oa = {"type": "function", "function": fn}
    assert tool_schema("g", oa) is oa


def test_a_tool_without_function_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="no function"):
        AgentLoop(tokenizer, LLMClient(), {"x": ({"type": "object"}, None)})


async def test_result_is_written_into_a_job(tokenizer):
    from prorl_server.job import Job

    r, _, _ = await run(tokenizer, [call("finish", answer="ok")])
    job = Job(job_id="j", instance={}, sampling_params={}, handler=None, handler_name="t", timeout_s=None)
    r.apply_to(job)
    assert job.trajectories == r.trajectories and job.messages == r.messages
    assert job.extra["agent"]["finish_reason"] == "stop"
