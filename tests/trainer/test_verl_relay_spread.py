"""The relay spreads jobs over verl's replicas (issue #22 item 4).

verl's global balancer is sticky on ``request_id`` and otherwise picks the replica with the fewest turns in
flight. The relay used to send a hash of the prompt's first 256 tokens as that id, so jobs whose prompts
share a long system prompt and tool schema (every handler's) all went to one replica: 1/N of the rollout
throughput. Now the id is the hash of a job's whole first prompt, carried on to its later turns: the samples
of one group share a replica (prefix cache), every turn of a job stays on it, other prompts spread by load.

Real here: verl's ``FullyAsyncLLMServerClient`` and ``GlobalRequestLoadBalancer``, the relay, the rollout
server and the agent loop as verl instantiates it. Stand-ins (from ``test_verl_registration.py``, each saying
what it stands for): Ray actor handles and verl's vLLM replica actors (two of them).
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")

_spec = importlib.util.spec_from_file_location("_verl_registration_helpers",
                                               Path(__file__).with_name("test_verl_registration.py"))
reg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reg)
turns, rollout_server = reg.turns, reg.rollout_server  # fixtures

SHARED = list(range(100, 400))  # a 300-token system prompt and tool schema every job's prompt starts with


@pytest.fixture
def cfg(compose_verl):
    return compose_verl(prompt_length=512, response_length=16)


def job_calls(replica):
    """(request_id, prompt_len) of the replica's job turns (the relay's 1-token version probe left out)."""
    return [(c["request_id"], c["prompt_len"]) for c in replica.calls if c["max_tokens"] != 1]


async def test_jobs_sharing_a_long_prefix_use_both_replicas_and_each_job_keeps_its_replica(
        cfg, tokenizer, rollout_server, monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replicas = [reg.ScriptedReplica(global_steps=1), reg.ScriptedReplica(global_steps=1)]
    client = reg.verl_client(cfg, *replicas)
    loop = reg.make_loop(cfg, tokenizer, client)
    for r in replicas:
        r.hold_after = 2  # every job turn parks after 2 tokens: the jobs are in flight together
    prompt_a, prompt_b = SHARED + [7, 8, 9], SHARED + [5, 6]
    group_a = [asyncio.ensure_future(loop.run(reg.SP, **reg.row(turns=2, prompt_ids=prompt_a, index=i)))
               for i in range(2)]  # two samples of one prompt (a GRPO group)

    async def parked(k):
        return sum(len(job_calls(r)) for r in replicas) >= k
    await reg.until(lambda: parked(2), 60)
    job_b = asyncio.ensure_future(loop.run(reg.SP, **reg.row(turns=2, prompt_ids=prompt_b, index=9)))
    await reg.until(lambda: parked(3), 60)
    for r in replicas:
        r.hold_after = None
        r.release.set()
    outs = await asyncio.wait_for(asyncio.gather(*group_a, job_b), 60)
    assert all(len(o) == 2 for o in outs)  # two turns each

    used = [r for r in replicas if job_calls(r)]
    assert len(used) == 2, f"every job went to one replica: {[job_calls(r) for r in replicas]}"
    # verl's balancer saw one sticky id per prompt: the group's two samples share one, the other prompt has its
    # own, and each id (so every turn of its jobs) stays on one replica
    sticky = [rid for rid in client.balancer.request_ids if not rid.startswith("prorl-relay-probe")]
    assert len(sticky) == 6 and len(set(sticky)) == 2
    homes = {rid: client.balancer._request_id_to_server[rid] for rid in set(sticky)}
    assert len(set(homes.values())) == 2
    # 2 turns x 3 jobs: 4 turns on the group's replica, 2 on the other
    assert sorted(len(job_calls(r)) for r in replicas) == [2, 4]
    assert dict(loop.relay.sticky.stats) == {"new_jobs": 3, "continued": 3}

def test_sticky_keys_follow_a_job_through_its_turns_and_forget_the_oldest():
    from trainer_plugins.verl.relay import StickyKeys

    keys = StickyKeys(max_contexts=2)
    rid_a, cont = keys.key(SHARED + [1])
    assert cont is None and keys.key(SHARED + [1])[0] == rid_a  # the same prompt: the same id (a group)
    assert keys.key(SHARED + [2])[0] != rid_a  # another prompt behind the same 300-token prefix
    keys.remember(SHARED + [1], [50, 51], rid_a)
    # the next turn's prompt extends the first turn's prompt and output (plus the environment's message)
    assert keys.key(SHARED + [1, 50, 51, 60, 61]) == (rid_a, (len(SHARED) + 3, pytest.approx(
        keys.key(SHARED + [1, 50, 51, 60, 61])[1][1])))
    assert keys.key(SHARED + [1, 50, 52])[1] is None  # a different output: not that job's context
    keys.remember(SHARED + [3], [1], "b")
    keys.remember(SHARED + [4], [1], "c")  # a third context: the oldest (job a's) is forgotten
    assert keys.key(SHARED + [1, 50, 51, 60])[1] is None
    assert keys.key(SHARED + [4, 1, 9])[0] == "c"
