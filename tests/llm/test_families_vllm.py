"""Token truth per model family against real vLLM CPU: each family's tiny test model (tiny random Qwen2 weights,
a tokenizer carrying the family's published chat template, see prorl_server.llm.chat_templates) served by vLLM;
an 8-turn tool-using rollout is one trajectory whose generated tokens and logprobs are exactly what vLLM
returned, and the logprobs are within 1e-3 of a transformers forward pass over the final sequence.

One vLLM server per family (module-scoped through the parametrized fixture, so pytest runs each family's
tests together and starts the next server after stopping the previous one): ~40-60 s each on 2 cores, so the
tier serves the families whose continuation rules differ (ChatML itself is served in test_vllm_rollouts.py).
Prints one ``family-table`` line per family (run with ``-s`` to see them)."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from prorl_server.llm.chat_templates import TEMPLATE_FAMILY, family_spec
from prorl_server.llm.conversation import Conversation
from prorl_server.llm.client import LLMClient

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 2048
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo a text.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Echo things."}]
# template -> chat template variables of its rollout
SERVED = {
    "qwen3": {"enable_thinking": False},  # every turn continued: the empty think block is not re-rendered
    "llama3_1": {},
    "mistral_v7_tekken": {},
    "gemma3": {},
    "deepseekv3": {},
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def family_server(request, family_model_dir):
    pytest.importorskip("vllm")
    from prorl_server.dev.vllm_launcher import start_vllm

    template = request.param
    model_dir = family_model_dir(template)
    t0 = time.monotonic()
    server = start_vllm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN,
                        log_path=ROOT / ".cache" / "logs" / f"vllm-family-{template}-{os.getpid()}.log",
                        timeout_s=300)
    print(f"\nvLLM for {template} started in {time.monotonic() - t0:.1f} s")
    yield template, model_dir, server
    server.stop()


def observation(family: str, turn: int, text: str) -> dict:
    m = {"role": family_spec(family).tool_role, "content": f"echo: {text[:24]!r} — ünïcode ✓"}
    if family == "mistral":
        m["tool_call_id"] = f"call{turn:05d}"
    return m


async def run_rollout(address: str, tokenizer, template: str, turns: int = 8):
    family = TEMPLATE_FAMILY[template + ".jinja"]
    conv = Conversation(tokenizer, START, tools=TOOLS, max_context_tokens=MAX_MODEL_LEN,
                        chat_template_kwargs=SERVED[template])
    # The random model samples only ordinary tokens and the end of turn: a template marker in the middle of a
    # turn ("[INST]", "</think>") is noise no trained model writes. The mask is applied after vLLM takes the
    # raw logprobs, so they stay comparable with the forward pass.
    added = set(tokenizer.get_added_vocab().values())
    allowed = [i for i in range(len(tokenizer)) if i not in added] + [tokenizer.eos_token_id]
    completions = []
    async with LLMClient() as llm:
        for i in range(turns):
            c = await llm.complete(list(conv.token_ids), backend=address, max_tokens=min(16, conv.room - 1),
                                   sampling_params={"temperature": 1.0, "seed": 1000 + i,
                                                    "allowed_token_ids": allowed})
            completions.append(c)
            msg = conv.add_completion(c)
            if i < turns - 1:
                assert await conv.add_messages([observation(family, i, msg["content"])])
    conv.finish("max_turns")
    return conv, completions


@pytest.fixture(scope="module")
def family_rollout(family_server):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template, model_dir, server = family_server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.monotonic()
    conv, completions = asyncio.run(run_rollout(server.address, tokenizer, template))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return template, conv, completions, hf, time.monotonic() - t0


def max_logprob_diff(hf_model, traj) -> float:
    import torch

    ids = traj.prompt_ids + traj.response_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    p = len(traj.prompt_ids)
    diffs = [abs(logp[p + i - 1, t].item() - lp)
             for i, (t, m, lp) in enumerate(zip(traj.response_ids, traj.loss_mask, traj.response_logprobs)) if m]
    assert len(diffs) == sum(traj.loss_mask) > 0
    return max(diffs)


def test_eight_turn_rollout_is_one_trajectory_of_vllms_tokens_and_logprobs(family_rollout):
    template, conv, completions, hf, seconds = family_rollout
    (traj,) = conv.trajectories()
    assert traj.split_reason is None and traj.num_turns == 8 == len(completions)
    spans = [ids for _, ids in traj.spans()]
    assert spans == [c.token_ids for c in completions if c.token_ids]
    assert [lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m] == \
        [lp for c in completions for lp in c.logprobs]
    diff = max_logprob_diff(hf, traj)
    stats = conv.token_stats()
    print(f"\nfamily-table {template} family={stats['family']} splits={sum(stats['splits'].values())} "
          f"continued={stats['continued']} max_logprob_diff={diff:.2e} tokens={len(traj.prompt_ids) + len(traj.response_ids)} "
          f"rollout_s={seconds:.1f}")
    assert stats["splits"] == {} and stats["turns"] == 8
    assert diff < 1e-3, f"max |logprob - transformers| = {diff}"
