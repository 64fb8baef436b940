"""The records target of issue #35: across 1,000 jobs (shout episodes, agent-loop episodes, gateway sessions with
``n = 1`` and ``n > 1`` requests) 100% of turns carry spans and times, the spans tile the sampled tokens (the
``loss_mask`` 1 positions of ``response_ids``, exactly), the weighted components sum to ``reward`` (to 1e-12) and
the turns' times add up to the job's ``run_s``.

Fast tier, no external process. The backend is the scripted policy of tests/conftest.py (a labelled test double
standing in for vLLM's token-in/token-out ``/v1/completions``). The agent-loop jobs run the loop the code and math
handlers run (:func:`prorl_server.plugin.toolkit.run_agent`) with in-process tools in place of a sandbox's; the
shipped code and math handlers in real bubblewrap sandboxes are the real tier's
(tests/core/test_turn_records.py::test_code_and_math_jobs_in_bubblewrap_carry_tiling_turn_records). The gateway
jobs' agent program is in-process too (a stand-in for a program in a sandbox): it sends Chat Completions bodies
through the gateway's own parser and session (what the HTTP route calls), bound to the job like ``cli_agent``'s.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

from handlers.shout import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.gateway.protocol import parse_chat_request
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.plugin.toolkit import run_agent
from prorl_server.rewards import STANDARD_TERMS, compose_reward, generated_texts, process_terms
from prorl_server.turn_records import turn_seconds
from prorl_server.types import JobResult

JOBS = 1000
TOOL_S = 0.002  # the loop's tool and the gateway agent's own time between answer and next request, seconds
MIXED = "Жz "  # a two-script start (Cyrillic, Latin), so the language-mixing term is not always 0


class LoopHandler(AgentHandler):
    """The agent loop of the code and math handlers with an in-process ``wait`` tool (sleeps :data:`TOOL_S`);
    outcome 1.0 when the finish tool's answer is "42", plus the standard process terms."""

    name = "loop_records"
    needs_llm = True
    reward_terms = STANDARD_TERMS

    async def run(self, job) -> None:
        async def wait(args: dict) -> str:
            await asyncio.sleep(TOOL_S)
            return "waited"

        tools = {"wait": ({"type": "object", "properties": {}}, wait)}
        res = await run_agent(job, [{"role": "user", "content": f"Task {job.instance['k']}."}], tools)
        job.state = res.answer

    async def eval(self, job) -> None:
        job.resolved = isinstance(job.state, dict) and job.state.get("answer") == "42"
        compose_reward(job, 1.0 if job.resolved else 0.0, process_terms(job))


class GatewayAgentHandler(AgentHandler):
    """A gateway session bound to the job, driven by an in-process agent program: ``instance["plan"]`` lists
    ``n`` per request and the choice it goes on with; outcome: the share of its answers that are long."""

    name = "gateway_records"
    needs_llm = True
    reward_terms = STANDARD_TERMS

    async def run(self, job) -> None:
        gw = job.services.gateway
        session = gw.create_session(job=job)
        messages = [{"role": "user", "content": f"Chat {job.instance['k']}."}]
        for i, (n, pick) in enumerate(job.instance["plan"]):
            req = parse_chat_request({"model": "m", "messages": messages, "n": n, "max_tokens": 8})
            answer, _ = await gw.chat(session, req)
            await asyncio.sleep(TOOL_S)  # the agent program's own time
            content = answer["choices"][pick]["message"]["content"]
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"again {i}"}]
        result = gw.finalize(session)
        job.trajectories = session.trajectories()
        job.turns = session.turn_records()
        job.messages = result["messages"]
        tok = await job.llm.tokenizer(await job.backend())
        job.state = generated_texts(job.trajectories, tok)

    async def eval(self, job) -> None:
        texts = job.state
        outcome = sum(len(t) > 6 for t in texts) / len(texts)
        job.resolved = outcome == 1.0
        compose_reward(job, outcome, process_terms(job, texts=texts))


def _script() -> "callable":
    counter = itertools.count()

    def script(prompt: str, turn: int) -> str:
        if "Task " in prompt:  # the agent loop: k % 3 tool turns, a parse error when k is odd, then finish
            k = int(prompt.split("Task ")[1].split(".")[0])
            if turn < k % 3:
                return f'{MIXED if k % 5 == 0 else ""}I wait.\n<tool_call>\n{{"name": "wait", "arguments": {{}}}}\n</tool_call>'
            if turn == k % 3 and k % 2:
                return '<tool_call>\n{"name": "wait", "arguments": {not json}\n</tool_call>'
            return '<tool_call>\n{"name": "finish", "arguments": {"answer": "42"}}\n</tool_call>'
        if "Chat " in prompt:  # gateway sessions: distinct choices of one n > 1 request
            return f"{MIXED if turn % 3 == 0 else ''}reply {next(counter)}"
        return MIXED + "LOUD WORDS" if turn % 3 == 2 else ("quiet words" if turn % 2 else "LOUD WORDS")

    return script


def _bodies(rng: random.Random) -> list[dict]:
    bodies = []
    for i in range(JOBS):
        kind = i % 3
        if kind == 0:
            bodies.append({"instance": {"data_source": "shout", "prompt": f"Talk {i}.", "turns": rng.randint(2, 6)},
                           "sampling_params": {"max_tokens": rng.choice([3, 12])},
                           "reward_weights": {"language_mixing": 0.1, "turn_scores": 0.3}})
        elif kind == 1:
            bodies.append({"instance": {"data_source": "loop_records", "k": i}, "sampling_params": {"max_tokens": 48},
                           "reward_weights": {"tool_call_errors": 0.2, "language_mixing": 0.1}})
        else:
            plan = [(n, rng.randrange(n)) for n in (rng.choice([1, 1, 2, 3]) for _ in range(rng.randint(1, 4)))]
            bodies.append({"instance": {"data_source": "gateway_records", "k": i, "plan": plan},
                           "reward_weights": {"tool_call_errors": 0.2, "language_mixing": 0.3}})
    return bodies


def _check(r: JobResult) -> tuple[int, float]:
    """Assert the target on one result; returns its number of turns and ``|turn seconds - run_s|``."""
    assert r.failure_kind is None, r.error
    assert r.turns and len(r.turns) == sum(t.num_turns for t in r.trajectories)
    branch = {i for i, t in enumerate(r.trajectories) if (t.split_reason or "").startswith("branch")}
    covered: dict[int, list[int]] = {i: [] for i in range(len(r.trajectories))}
    for t in r.turns:
        traj = r.trajectories[t.trajectory_index]
        assert 0 <= t.response_start <= t.response_end <= len(traj.response_ids)
        covered[t.trajectory_index].extend(range(t.response_start, t.response_end))
        assert t.finish_reason in ("stop", "length")
        times = (t.t_llm_s, t.t_tool_s, t.t_tool_critical_s, t.t_wait_s)
        assert all(math.isfinite(v) and v >= 0 for v in times)
        if t.trajectory_index in branch:  # a branch's records: spans and counts; the time is the continued turn's
            assert times == (0.0, 0.0, 0.0, 0.0)
        else:
            assert t.t_llm_s > 0 and t.t_tool_critical_s <= t.t_tool_s
    for i, traj in enumerate(r.trajectories):
        assert covered[i] == [k for k, m in enumerate(traj.loss_mask) if m], f"{r.handler}: trajectory {i}"
    comps = r.reward_components
    assert abs(math.fsum(c.weight * c.value for c in comps.values()) - r.reward) <= 1e-12
    # the turns' shares of it too, to the same 1e-12 (finalize puts the rounding rest on the last turn; one share
    # cannot always make the correctly rounded sum land on reward exactly)
    assert abs(math.fsum(t.reward for t in r.turns) - r.reward) <= 1e-12
    return len(r.turns), abs(turn_seconds(r) - r.timing.run_s)


async def test_a_thousand_jobs_turns_carry_spans_and_times_that_tile_sum_and_add_up(aiohttp_client,
                                                                                     scripted_policy):
    registry = HandlerRegistry()
    for h in (ShoutHandler, LoopHandler, GatewayAgentHandler):
        registry.register(h)
    app = create_app(ServerSettings(backends=[await scripted_policy(_script())], health_interval_s=3600,
                                    run_workers=256, eval_workers=64, init_workers=64), registry=registry)
    client = await aiohttp_client(app)
    bodies = _bodies(random.Random(35))
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(256)

    async def post(body: dict) -> JobResult:
        async with sem:
            r = await client.post("/process", json=body)
            assert r.status == 200, await r.text()
            return JobResult(**await r.json())

    results = await asyncio.gather(*(post(b) for b in bodies))
    wall = time.perf_counter() - t0
    checked = [_check(r) for r in results]
    turns = sum(n for n, _ in checked)
    drift = max(d for _, d in checked)
    by = {h: sum(r.handler == h for r in results) for h in ("shout", "loop_records", "gateway_records")}
    branches = sum((t.split_reason or "").startswith("branch") for r in results for t in r.trajectories)
    mixing = sum(r.reward_components["language_mixing"].value < 0 for r in results)
    print(f"\n{len(results)} jobs {by}, {turns} turns ({branches} n > 1 branches), all tiled and timed; "
          f"components sum to reward; max |turn seconds - run_s| {drift:.1e} s; {mixing} jobs with a "
          f"language-mixing penalty; {wall:.1f} s")
    assert len(results) == JOBS and turns > 3 * JOBS and branches > 50 and mixing > 100
    # the turns' times add up to run_s: the clock's resolution, and float rounding of the sums
    assert drift < 1e-6
