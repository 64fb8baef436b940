"""Infrastructure cannot move the time reward (issue #35, Targets): a fixed scripted agent's model time varies by
at most 5% (coefficient of variation) while the system's delays make its wall time vary by at least 50%, and
the agent making its 3 tool calls in parallel beats the same agent making them in sequence in >= 99% of groups.

Fast tier: everything runs in this process. The server is the real one (pipeline, run-stage backlog, LLM client
and failover, weight swaps, completion-time groups); its backends are :class:`prorl_server.dev.fake_vllm.FakeVLLM`
standing for vLLM 0.31 started with ``--enable-per-request-metrics`` and serving a model whose turns are fixed:
it generates the script's tokens one per ``STEP_S`` engine step, on its own clock (``catch_up``: an
accelerator's step time does not depend on the host's load). The tools are in-process sleeps of ``WORK_S``.
One long-lived server runs ``WAVES`` waves; each wave's jobs arrive over ``SPREAD_S`` seconds while, at random
moments early in the wave, the system does what it does to rollouts:

- queueing: more jobs than run workers (``RUN_WORKERS``), so some wait in the backlog;
- sandbox start: half the jobs' init sleeps 0-2 s (a cold sandbox; the rest come from a pool), a quarter open
  their "sandbox" in ``run`` (0-2 s before the first turn: charged to the first turn's ``t_wait_s``);
- the trainer pausing its vLLMs itself (abort mode) for 0-2 s: turns in flight come back aborted and are
  re-sent, turns sent during the pause wait in the engine's queue;
- a weight swap through the rollout server (keep mode) holding 0-2 s;
- a failover: backend B dies mid-turn (its connections dropped), the turn is re-sent to A.

Jobs that arrive late in a wave meet none of it, so wall times spread. Each group is the two agents (calls in
sequence, calls in parallel) with ``completion_time`` on; the server's ``speed`` says which won. 1,000 groups
through the server would take ~30 min on the shared 2-core machine; the test runs ``WAVES * GROUPS`` = 24 in
~50 s (the issue's >= 99% then means every one). The 1,000 groups, measured with
``PRORL_TIMING_NOISE=10,100,12,30`` (5.5 min): model-time CV 0.001 (sequential) and 0.003 (parallel), wall-time CV
0.528 and 0.605, 54 runs failed over, 21 re-sent after a pause, parallel beat sequential in 1,000 of 1,000 groups.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import statistics
import time

import pytest

from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.dev.fake_vllm import start_fake_vllm
from prorl_server.llm.agent_loop import AgentConfig, parallel_safe
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.plugin.toolkit import run_agent

STEP_S = 0.005  # seconds per generated token
WORK_S = 0.1  # seconds per tool call
# the 1,000 groups, as a measurement outside CI: PRORL_TIMING_NOISE="10,100,12,30" (waves, groups a wave,
# run workers, spread seconds) runs 10 x 100 groups in ~10 min; the CI run keeps the defaults
WAVES, GROUPS, RUN_WORKERS = 3, 8, 3
SPREAD_S = 14.0  # a wave's jobs are submitted over this many seconds
if os.environ.get("PRORL_TIMING_NOISE"):
    _w, _g, _r, _s = os.environ["PRORL_TIMING_NOISE"].split(",")
    WAVES, GROUPS, RUN_WORKERS, SPREAD_S = int(_w), int(_g), int(_r), float(_s)


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def agent_script(tokenizer):
    """``prompt ids -> generated ids`` of the scripted agent: turn 0 makes three ``work`` calls, turn 1 calls
    finish (each ended with ``<|im_end|>`` as vLLM keeps the stop token)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [tokenizer.encode("".join(call("work", i=i) for i in range(3)), add_special_tokens=False) + [end],
             tokenizer.encode(call("finish", answer="done"), add_special_tokens=False) + [end]]

    def script(prompt_ids: list[int]) -> list[int]:
        return turns[min(1, tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1)]
    return script


@parallel_safe
async def work(args: dict) -> str:
    await asyncio.sleep(WORK_S)
    return f"worked {args.get('i')}"


class ScriptedAgentHandler(AgentHandler):
    """The scripted agent: ``instance["parallel"]`` runs its calls side by side; ``init_s`` / ``setup_s``:
    seconds its sandbox takes to start in init / in run (stand-ins for a sandbox start)."""

    name = "scripted_agent"
    needs_llm = True

    async def init(self, job) -> None:
        await asyncio.sleep(job.instance["init_s"])

    async def run(self, job) -> None:
        await asyncio.sleep(job.instance["setup_s"])
        res = await run_agent(job, [{"role": "user", "content": "Work three times, then finish."}],
                              {"work": ({"type": "object", "properties": {"i": {"type": "integer"}}}, work)},
                              AgentConfig(parallel_tool_calls=job.instance["parallel"]))
        job.state = res.answer

    def restore_for_eval(self, job, result) -> None:
        """Eval reads nothing the run left."""

    async def eval(self, job) -> None:
        job.resolved = True
        job.reward = 1.0


async def until(cond, patience_s: float = 30.0) -> bool:
    end = asyncio.get_running_loop().time() + patience_s
    while not cond():
        if asyncio.get_running_loop().time() > end:
            return False
        await asyncio.sleep(0.005)
    return True


async def faults(client, fakes, rng: random.Random, wave: int) -> dict:
    """The system's doings during one wave, at random moments; returns what was injected (seconds)."""
    a, b = fakes
    done = {}
    await asyncio.sleep(rng.uniform(0.3, 1.0))
    # the trainer pauses its vLLMs itself (abort mode), while turns are in flight
    await until(lambda: sum(len(f.running) for f in fakes) >= 2, 5.0)
    done["pause_s"] = d = rng.uniform(0.0, 2.0)
    for f in fakes:
        f._unpaused.clear()
        f.paused = "abort"
        for r in list(f.running.values()):
            f._end(r, "abort")
    await asyncio.sleep(d)
    for f in fakes:
        f.paused = None
        f._unpaused.set()
    await asyncio.sleep(rng.uniform(0.0, 0.5))
    # a weight swap through the rollout server (keep mode): the turns freeze in the engine
    done["swap_s"] = d = rng.uniform(0.0, 2.0)
    paused = await (await client.post("/weights/pause", json={"weight_version": wave + 1})).json()
    await asyncio.sleep(d)
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "weight_version": wave + 1})
    assert r.status == 200, await r.text()
    # backend B dies mid-turn
    await until(lambda: bool(b.running), 5.0)
    done["b_running_at_crash"] = len(b.running)
    b.crash()
    return done


async def run_wave(client, fa, a: str, tiny_model_dir, script, rng: random.Random, wave: int):
    """One wave on the long-lived server: backend A and a fresh backend B (the one that dies)."""
    fb, rb, b = await start_fake_vllm(step_s=STEP_S, model=str(tiny_model_dir), script=script,
                                      per_request_metrics=True, catch_up=True)
    try:
        assert (await client.post("/clear_llm_server")).status == 200  # last wave's dead B leaves the rotation
        for addr in (a, b):
            r = await client.post("/add_llm_server", json={"address": addr, "weight_version": wave})
            assert r.status == 200
        ids, bodies = [], []
        for g in range(GROUPS):
            for parallel in (False, True):
                job_id = f"w{wave}-g{g}-{'par' if parallel else 'seq'}"
                # a sandbox from the pool starts at once, a cold one takes up to 2 s; a quarter start in run
                init = rng.uniform(0.0, 2.0) if rng.random() < 0.5 else 0.0
                setup = rng.uniform(0.0, 2.0) if rng.random() < 0.25 else 0.0
                bodies.append((rng.uniform(0.0, SPREAD_S), {
                    "job_id": job_id, "group_id": f"w{wave}-g{g}", "group_size": 2, "completion_time": True,
                    "instance": {"data_source": "scripted_agent", "parallel": parallel,
                                 "init_s": init, "setup_s": setup},
                    "sampling_params": {"max_tokens": 256}}))
                ids.append(job_id)

        async def submit(at: float, body: dict) -> None:
            await asyncio.sleep(at)  # jobs arrive over the wave: some meet the faults below, some do not
            assert (await client.post("/jobs", json=body)).status == 202

        _, injected = await asyncio.gather(asyncio.gather(*(submit(*b) for b in bodies)),
                                           faults(client, (fa, fb), rng, wave))
        results = {}
        for job_id in ids:
            while True:
                st = await (await client.get(f"/jobs/{job_id}")).json()
                if st["state"] == "done":
                    results[job_id] = st["result"]
                    break
                await asyncio.sleep(0.02)
        return results, injected
    finally:
        await rb.cleanup()


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


def model_time(r: dict) -> float:
    return sum(t["t_llm_s"] + t["t_tool_critical_s"] for t in r["turns"])


def wall_time(r: dict) -> float:
    return sum(r["timing"][k] for k in ("queue_s", "init_s", "run_s", "eval_s"))


async def test_system_delays_move_wall_time_but_not_model_time_and_parallel_calls_win(aiohttp_client, tokenizer,
                                                                                     tiny_model_dir):
    registry = HandlerRegistry()
    registry.register(ScriptedAgentHandler)
    script = agent_script(tokenizer)
    rng = random.Random(35)
    results: dict[str, dict] = {}
    lags = [0.0]  # the event loop's lateness, seconds: a starved test process stretches the in-process tools

    async def watch_loop() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - t - 0.01)
    mon = asyncio.create_task(watch_loop())
    fa, ra, a = await start_fake_vllm(step_s=STEP_S, model=str(tiny_model_dir), script=script,
                                      per_request_metrics=True, catch_up=True)
    client = await aiohttp_client(create_app(ServerSettings(
        tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[a], run_workers=RUN_WORKERS,
        sandbox_runtime="none"), registry=registry))
    # one job first: the server's one-time work (chat template, parser) is not any timed run's
    warm = await client.post("/process", json={"instance": {"data_source": "scripted_agent", "parallel": False,
                                                            "init_s": 0.0, "setup_s": 0.0}})
    assert (await warm.json())["failure_kind"] is None
    # The server freezes what the first job loads (its tokenizer) at its collector control's next check after
    # the load (prorl_server.gc_control, within a second); full collections walking the tokenizer stall the loop
    # 0.1-0.5 s (measured), so freeze here at once: no timed wave starts before that check.
    gc.freeze()
    try:
        for wave in range(WAVES):
            got, injected = await run_wave(client, fa, a, tiny_model_dir, script, rng, wave)
            print(f"wave {wave}: injected {injected}")
            results.update(got)
    finally:
        gc.unfreeze()
        mon.cancel()
        await ra.cleanup()
    for job_id, r in results.items():
        assert r["failure_kind"] is None and r["resolved"], (job_id, r["error"])
        assert [t["tool_calls"] for t in r["turns"]] == [3, 1], job_id
    agents = {kind: [r for j, r in results.items() if j.endswith(kind)] for kind in ("seq", "par")}
    faults_seen = {k: sum(r["extra"]["agent"][k] > 0 for r in results.values())
                   for k in ("llm_failovers", "llm_pause_retries")}
    for kind, rs in agents.items():
        m, w = [model_time(r) for r in rs], [wall_time(r) for r in rs]
        print(f"{kind}: model time mean {statistics.fmean(m):.3f} s, CV {cv(m):.3f}; "
              f"wall time mean {statistics.fmean(w):.3f} s, CV {cv(w):.3f} ({len(rs)} runs)")
    print(f"runs that failed over: {faults_seen['llm_failovers']}, re-sent after a pause: "
          f"{faults_seen['llm_pause_retries']}")
    wins = sum(results[f"w{w}-g{g}-par"]["speed"] > results[f"w{w}-g{g}-seq"]["speed"]
               for w in range(WAVES) for g in range(GROUPS))
    print(f"parallel beat sequential in {wins} of {WAVES * GROUPS} groups; the event loop was late by up to "
          f"{max(lags):.3f} s")
    assert faults_seen["llm_failovers"] > 0 and faults_seen["llm_pause_retries"] > 0
    for kind, rs in agents.items():
        # (a failure with the loop late by >= 0.3 s: other processes starved this one, and its in-process tools'
        # host-timed sleeps stretched with it)
        assert cv([model_time(r) for r in rs]) <= 0.05, (kind, max(lags))
        assert cv([wall_time(r) for r in rs]) >= 0.5, kind
    assert wins >= 0.99 * WAVES * GROUPS


async def test_a_turn_sent_to_a_paused_engine_charges_the_pause_to_the_system(tiny_model_dir):
    """vLLM queues a request sent while its trainer has paused it (abort mode) and answers after ``/resume``: that
    wait is the engine's queue (its ``metrics.queue_time_ms``), never the model's generation."""
    from prorl_server.llm.client import LLMClient

    fake, runner, addr = await start_fake_vllm(step_s=STEP_S, model=str(tiny_model_dir), per_request_metrics=True,
                                               catch_up=True)
    llm = LLMClient()
    try:
        fake._unpaused.clear()
        fake.paused = "abort"
        turn = asyncio.create_task(llm.complete(list(range(10, 40)), backend=addr, max_tokens=20))
        await asyncio.sleep(0.5)
        fake.paused = None
        fake._unpaused.set()
        comp = await turn
    finally:
        await llm.close()
        await runner.cleanup()
    assert len(comp.token_ids) == 20
    assert comp.llm_s < 20 * STEP_S + 0.1, comp.llm_s  # 0.1 s of generation, not 0.6
    assert comp.wait_s >= 0.45


async def test_a_starved_host_does_not_stretch_generation_the_engine_timed(tiny_model_dir):
    """The server's own event loop stalling while a turn generates (another process took the CPU, a garbage
    collection) delays when the answer is read; the engine's clock says how long generation took."""
    from prorl_server.llm.client import LLMClient

    fake, runner, addr = await start_fake_vllm(step_s=STEP_S, model=str(tiny_model_dir), per_request_metrics=True,
                                               catch_up=True)
    llm = LLMClient()
    try:
        turn = asyncio.create_task(llm.complete(list(range(10, 40)), backend=addr, max_tokens=40))
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # the whole process stalls, the fake engine's steps are made up when it wakes
        comp = await turn
    finally:
        await llm.close()
        await runner.cleanup()
    assert len(comp.token_ids) == 40
    assert comp.llm_s < 40 * STEP_S + 0.05, comp.llm_s  # 0.2 s of generation, not 0.45
