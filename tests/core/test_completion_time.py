"""Relative completion time (issue #35 part 3): the formula, delivery with the group, and that the system's delays
(a backend paused by its trainer, a weight swap that freezes requests in the engine) do not move ``speed``.

The server is the real one (pipeline, LLM client, weight swaps); its backend is
:class:`prorl_server.dev.fake_vllm.FakeVLLM`, standing for vLLM 0.31's completions and development endpoints:
it generates one token per request every ``step_s``, so a member's model time is set by its ``max_tokens``.
"""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from prorl_server.app import create_app
from prorl_server.completion_time import relative_speeds
from prorl_server.config import ServerSettings
from prorl_server.dev.fake_vllm import start_fake_vllm
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.plugin.toolkit import run_agent

STEP_S = 0.02
TOKENS = [20, 40, 60, 80]  # model times ~0.4, 0.8, 1.2, 1.6 s: median 1.0, speeds 0.6, 0.2, -0.2, -0.6
EXPECTED = [0.6, 0.2, -0.2, -0.6]


def test_speed_is_the_clipped_relative_distance_to_the_resolved_median():
    assert relative_speeds([(True, 1.0), (True, 3.0), (False, 0.1)]) == [0.5, -0.5, 0.0]
    assert relative_speeds([(True, 1.0), (True, 10.0), (True, 2.0)]) == [0.5, -1.0, 0.0]  # clipped at -1
    assert relative_speeds([(True, 1.0), (False, 0.5), (False, 9.0)]) == [0.0, 0.0, 0.0]  # < 2 resolved
    assert relative_speeds([]) == []


class OneTurnHandler(AgentHandler):
    """A test handler: one generated turn through the agent loop (the fake's tokens call no tool), always
    resolved, so every member's speed is set by its model time alone."""

    name = "one_turn"
    needs_llm = True

    async def run(self, job) -> None:
        await run_agent(job, [{"role": "user", "content": "Go."}], {})

    def restore_for_eval(self, job, result) -> None:
        """Eval reads nothing the run left."""

    async def eval(self, job) -> None:
        job.resolved, job.reward = True, 1.0


@pytest.fixture
def settings(request, tmp_path) -> dict:
    """The server's extra settings (``journal``: a file name under ``tmp_path``)."""
    extra = dict(getattr(request, "param", {}))
    if "journal" in extra:
        extra["journal"] = str(tmp_path / extra["journal"])
    return extra


@pytest.fixture
async def server(aiohttp_client, tiny_model_dir, settings):
    # vLLM started with --enable-per-request-metrics on a device whose step time does not follow the host's load
    # (per_request_metrics, catch_up): the client caps t_llm_s at the engine's own time, so a starved test process
    # does not stretch a member's model time (before, the speeds missed by 0.4 on a loaded 2-core host)
    fake, runner, addr = await start_fake_vllm(step_s=STEP_S, model=str(tiny_model_dir), per_request_metrics=True,
                                               catch_up=True)
    reg = HandlerRegistry()
    reg.register(OneTurnHandler)
    settings = {"sandbox_runtime": "none", **settings}  # the handler needs no sandbox
    app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[], **settings),
                     registry=reg)
    client = await aiohttp_client(app)
    assert (await client.post("/add_llm_server", json={"address": addr, "weight_version": 0})).status == 200
    yield client, fake
    await runner.cleanup()


def body(group: str, i: int, tokens: int) -> dict:
    return {"job_id": f"{group}-{i}", "group_id": group, "group_size": len(TOKENS), "completion_time": True,
            "instance": {"data_source": "one_turn"}, "sampling_params": {"max_tokens": tokens}}


async def until(cond, patience_s: float = 30.0) -> None:
    end = asyncio.get_running_loop().time() + patience_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def run_group(client, fake, group: str, delays: list[float]) -> list[dict]:
    for i, n in enumerate(TOKENS):
        assert (await client.post("/jobs", json=body(group, i, n))).status == 202
    for k, d in enumerate(delays):
        await until(lambda: len(fake.running) == len(TOKENS) and min(len(r.tokens) for r in fake.running.values()) >= 5)
        if k % 2 == 0:  # the trainer pauses vLLM itself (abort mode): the turns come back aborted and are re-sent
            fake._unpaused.clear()
            fake.paused = "abort"
            for r in list(fake.running.values()):
                fake._end(r, "abort")
            await asyncio.sleep(d)
            fake.paused = None
            fake._unpaused.set()
        else:  # a weight swap through the rollout server (keep mode): the turns freeze in the engine
            paused = await (await client.post("/weights/pause", json={"weight_version": k})).json()
            await asyncio.sleep(d)
            r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "weight_version": k})
            assert r.status == 200, await r.text()
    out = []
    for i in range(len(TOKENS)):
        while True:
            st = await (await client.get(f"/jobs/{group}-{i}")).json()
            if st["state"] == "done":
                out.append(st["result"])
                break
            await asyncio.sleep(0.02)
    return out


async def test_system_delays_do_not_move_speed_while_they_move_wall_time(server):
    client, fake = server
    clean = await run_group(client, fake, "clean", [])
    rng = random.Random(7)
    delays = [rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)]
    delayed = await run_group(client, fake, "delayed", delays)
    for res in (clean, delayed):
        assert [r["failure_kind"] for r in res] == [None] * len(TOKENS)
        assert [r["speed"] for r in res] == pytest.approx(EXPECTED, abs=0.12)
    for r in delayed:  # each member sat through both delays: its wall time, never its model time
        model = sum(t["t_llm_s"] + t["t_tool_critical_s"] for t in r["turns"])
        wall = sum(r["timing"][k] for k in ("queue_s", "init_s", "run_s", "eval_s"))
        assert wall > model + 0.9 * sum(delays)
        assert sum(t["t_wait_s"] for t in r["turns"]) > 0.9 * sum(delays)


async def test_a_member_is_answered_only_when_its_group_ends(server):
    client, fake = server
    ids = []
    for i, n in enumerate(TOKENS[:3]):
        assert (await client.post("/jobs", json=body("g", i, n))).status == 202
        ids.append(f"g-{i}")
    await until(lambda: not fake.running and fake.counts["requests"] >= 3)
    await asyncio.sleep(0.3)
    states = [(await (await client.get(f"/jobs/{j}")).json())["state"] for j in ids]
    assert "done" not in states  # held: the group's speed is not known yet
    r = await client.post("/process", json=body("g", 3, TOKENS[3]))
    last = await r.json()
    assert last["speed"] == pytest.approx(EXPECTED[3], abs=0.12)
    firsts = [(await (await client.get(f"/jobs/{j}")).json())["result"]["speed"] for j in ids]
    assert firsts == pytest.approx(EXPECTED[:3], abs=0.12)


async def test_completion_time_without_a_group_is_refused(server):
    client, _ = server
    r = await client.post("/jobs", json={"instance": {"data_source": "one_turn"}, "completion_time": True})
    assert r.status == 422


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 2.0}], indirect=True)
async def test_a_group_whose_members_never_all_come_is_answered_after_the_wait(server):
    client, _ = server
    answers = await asyncio.gather(*(client.post("/process", json=body("short", i, TOKENS[2 * i]))
                                     for i in range(2)))  # 2 of the 4 members announced
    speeds = [(await a.json())["speed"] for a in answers]
    assert speeds == pytest.approx([1 / 2, -1 / 2], abs=0.12)  # T ~0.4 and ~1.2 s: median 0.8


@pytest.mark.parametrize("settings", [{"journal": "j.sqlite"}], indirect=True)
async def test_speeds_are_journalled_with_the_results_and_kept_by_a_regrade(server, settings):
    from prorl_server.journal.regrade import Regrader
    from prorl_server.journal.store import Journal

    client, _ = server
    answers = await asyncio.gather(*(client.post("/process", json=body("jg", i, n)) for i, n in enumerate(TOKENS)))
    speeds = [(await a.json())["speed"] for a in answers]
    assert speeds == pytest.approx(EXPECTED, abs=0.12)
    journal = Journal(settings["journal"], readonly=True)
    recorded = [json.loads(journal.result(f"jg-{i}"))["speed"] for i in range(len(TOKENS))]
    assert recorded == speeds
    registry = HandlerRegistry()
    registry.register(OneTurnHandler)
    async with Regrader(registry, sandbox_runtime="none") as g:
        out = await g.regrade("jg-0", "one_turn", json.dumps(body("jg", 0, TOKENS[0])).encode(),
                              journal.result("jg-0"))
    assert out.status == "regraded" and out.result.speed == speeds[0], out


async def test_held_members_give_back_their_admission_slots(server):
    """With room for 2 jobs at a time, a group of 4 still ends: a held member does not keep its slot."""
    from prorl_server.admission import AdmissionGate
    from prorl_server.app import PIPELINE

    client, _ = server
    client.app[PIPELINE].admission = AdmissionGate(target_lag_s=1.0, initial_limit=2, min_limit=1, max_limit=2)
    answers = await asyncio.wait_for(asyncio.gather(
        *(client.post("/process", json=body("adm", i, n)) for i, n in enumerate(TOKENS))), 60)
    speeds = [(await a.json())["speed"] for a in answers]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > 0 > speeds[-1]  # all answered, in order


def weighted(group: str, i: int, tokens: int, w: float) -> dict:
    return {**body(group, i, tokens), "reward_weights": {"speed": w}}


@pytest.mark.parametrize("settings", [{"journal": "j.sqlite"}], indirect=True)
async def test_speed_named_in_reward_weights_enters_the_reward_and_a_regrade_reproduces_it(server, settings):
    """``reward_weights: {"speed": w}`` adds the component ``speed`` (on the last turn) to every member: ``reward``
    = outcome + w * speed, the turns' rewards sum to it, ``resolved`` is the task's; the journal holds the final
    components and ``prorl-journal regrade`` gives them back byte for byte."""
    from prorl_server.journal.regrade import Regrader
    from prorl_server.journal.store import Journal

    client, _ = server
    w = 0.5
    answers = await asyncio.gather(*(client.post("/process", json=weighted("sg", i, n, w))
                                     for i, n in enumerate(TOKENS)))
    results = [await a.json() for a in answers]
    for r in results:
        speed = r["speed"]
        comp = r["reward_components"]["speed"]
        assert comp["value"] == speed and comp["weight"] == w
        assert comp["per_turn"] == [0.0] * (len(r["turns"]) - 1) + [speed]
        assert r["reward"] == pytest.approx(1.0 + w * speed, abs=1e-12) and r["resolved"] is True
        assert sum(t["reward"] for t in r["turns"]) == pytest.approx(r["reward"], abs=1e-12)
        assert r["turns"][-1]["reward"] == pytest.approx(1.0 + w * speed, abs=1e-12)
    assert results[0]["speed"] > 0 > results[-1]["speed"]  # the fastest member earns, the slowest pays
    # completion_time alone (no weight for speed, as before speed was a component) leaves the reward the outcome
    plain = await asyncio.gather(*(client.post("/process", json=body("plain", i, n)) for i, n in enumerate(TOKENS)))
    for r in [await a.json() for a in plain]:
        assert r["speed"] is not None and r["reward"] == 1.0 and set(r["reward_components"]) == {"outcome"}
    journal = Journal(settings["journal"], readonly=True)
    registry = HandlerRegistry()
    registry.register(OneTurnHandler)
    for i, r in enumerate(results):
        recorded = json.loads(journal.result(f"sg-{i}"))
        assert recorded["reward_components"] == r["reward_components"] and recorded["reward"] == r["reward"]
        async with Regrader(registry, sandbox_runtime="none") as g:
            out = await g.regrade(f"sg-{i}", "one_turn", json.dumps(weighted("sg", i, TOKENS[i], w)).encode(),
                                  journal.result(f"sg-{i}"))
        assert out.status == "regraded" and not out.changed, out
        assert out.result.model_dump_json(include={"reward", "reward_components", "turns", "speed"}) == \
            json.dumps({k: recorded[k] for k in ("reward", "reward_components", "turns", "speed")},
                       separators=(",", ":"))


def test_a_handler_cannot_declare_the_servers_speed_component():
    class Speedy(OneTurnHandler):
        name = "speedy"
        reward_terms = ("speed",)

    with pytest.raises(ValueError, match="speed"):
        HandlerRegistry().register(Speedy)


async def test_speed_in_reward_weights_without_completion_time_is_refused(server):
    client, _ = server
    b = {"job_id": "lone", "instance": {"data_source": "one_turn"}, "reward_weights": {"speed": 1.0}}
    r = await client.post("/jobs", json=b)
    assert r.status == 422, await r.text()
    message = (await r.json())["error"]["message"]
    assert "speed" in message and "completion_time" in message


class FlakyTurnHandler(OneTurnHandler):
    """:class:`OneTurnHandler` whose init fails (a fault of the harness, before the model acted: filtered, the
    system's doing) when the instance says ``fail``; stands for a sandbox that could not start."""

    name = "flaky_turn"

    async def init(self, job) -> None:
        if job.instance.get("fail"):
            raise RuntimeError("injected: the sandbox could not start")


def member(group: str, job_id: str, tokens: int, size: int = 2, fail: bool = False) -> dict:
    return {"job_id": job_id, "group_id": group, "group_size": size, "completion_time": True,
            "instance": {"data_source": "flaky_turn", "fail": fail}, "sampling_params": {"max_tokens": tokens}}


async def state(client, job_id: str) -> dict:
    return await (await client.get(f"/jobs/{job_id}")).json()


@pytest.fixture
async def flaky(server):
    from prorl_server.app import REGISTRY

    client, fake = server
    client.app[REGISTRY].register(FlakyTurnHandler)
    return client, fake


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_a_member_of_a_group_that_ended_is_answered_at_once_with_speed_0(flaky):
    """R17: a group id reused after its group ended (a trainer's retry of a filtered member) is not a new group
    that waits ``completion_time_wait_s`` for members that never come."""
    client, _ = flaky
    firsts = await asyncio.gather(*(client.post("/process", json=member("ended", f"e-{i}", n))
                                    for i, n in enumerate((20, 60))))
    speeds = [(await a.json())["speed"] for a in firsts]
    assert speeds[0] > 0 > speeds[1]  # ~0.5 and ~-0.5; signs only: the host's load moves step times
    late = await asyncio.wait_for(client.post("/process", json=member("ended", "e-late", 20)), 10)
    result = await late.json()
    assert result["speed"] == 0.0 and result["resolved"] is True


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_a_member_with_another_group_size_or_beyond_the_size_is_refused(flaky):
    """R9: sizes disagree -> 409 naming both; a third member of a size-2 group with no filtered member -> 409."""
    client, _ = flaky
    assert (await client.post("/jobs", json=member("sz", "sz-0", 20))).status == 202
    r = await client.post("/jobs", json=member("sz", "sz-1", 20, size=3))
    assert r.status == 409, await r.text()
    err = (await r.json())["error"]
    assert err["type"] == "group_size_mismatch" and err["field"] == "group_size"
    assert "3" in err["message"] and "2" in err["message"]
    assert (await client.post("/jobs", json=member("sz", "sz-1", 20))).status == 202
    r = await client.post("/jobs", json=member("sz", "sz-2", 20))
    assert r.status == 409, await r.text()
    err = (await r.json())["error"]
    assert err["type"] == "group_full" and "replace" in err["message"]


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_a_filtered_member_is_answered_at_once_and_its_group_waits_for_its_replacement(flaky):
    """R9: a member the system failed (filtered) is answered at once, so the trainer can re-submit it; the group
    takes the re-submission beyond its size and waits for it, so the fault costs no member its speed."""
    client, fake = flaky
    assert (await client.post("/jobs", json=member("rp", "rp-0", 20))).status == 202
    failed = await asyncio.wait_for(client.post("/process", json=member("rp", "rp-1", 60, fail=True)), 10)
    failed = await failed.json()
    assert failed["filter"] is True and failed["speed"] == 0.0
    await until(lambda: not fake.running and fake.counts["requests"] >= 1)
    await asyncio.sleep(0.3)
    assert (await state(client, "rp-0"))["state"] != "done"  # held for the replacement
    again = await asyncio.wait_for(client.post("/process", json=member("rp", "rp-1b", 60)), 20)
    # both members in the median (~0.5 and ~-0.5; signs only: the host's load moves step times)
    assert (await again.json())["speed"] < 0 < (await state(client, "rp-0"))["result"]["speed"]


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 2.0}], indirect=True)
async def test_a_group_whose_filtered_member_is_not_replaced_ends_after_the_wait(flaky):
    client, _ = flaky
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ok = asyncio.ensure_future(client.post("/process", json=member("nr", "nr-0", 20)))
    failed = await (await client.post("/process", json=member("nr", "nr-1", 20, fail=True))).json()
    assert failed["filter"] is True
    assert not ok.done()  # waits for a replacement, not answered on the filtered attempt
    result = await (await asyncio.wait_for(ok, 20)).json()
    assert loop.time() - t0 >= 1.9 and result["speed"] == 0.0  # the group's wait; one resolved member: 0


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_cancel_of_a_held_member_answers_at_once_and_does_not_hold_its_group(flaky):
    """R15: ``POST /cancel`` of a member whose result is held answers at once (``cancelled: true``), its result is
    filtered ``cancelled``, and the rest of its group ends without waiting for it or a replacement."""
    client, fake = flaky
    assert (await client.post("/jobs", json=member("cx", "cx-0", 20, size=3))).status == 202
    await until(lambda: not fake.running and fake.counts["requests"] >= 1)
    await asyncio.sleep(0.2)
    assert (await state(client, "cx-0"))["state"] != "done"  # held
    r = await asyncio.wait_for(client.post("/cancel", json={"job_id": "cx-0"}), 5)
    assert await r.json() == {"job_id": "cx-0", "cancelled": True, "state": "done"}
    result = (await state(client, "cx-0"))["result"]
    assert result["failure_kind"] == "cancelled" and result["filter"] is True and result["reward"] == 0.0
    rest = await asyncio.wait_for(asyncio.gather(
        *(client.post("/process", json=member("cx", f"cx-{i}", n, size=3)) for i, n in ((1, 20), (2, 60)))), 20)
    speeds = [(await a.json())["speed"] for a in rest]
    assert speeds[0] > 0 > speeds[1]  # the cancelled member is out of the median (signs only, as above)


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_cancel_of_a_running_member_answers_at_once_and_does_not_hold_its_group(flaky):
    """R15 for a member still generating: its cancel is answered when it ends, not when its group ends."""
    client, fake = flaky
    slow = asyncio.ensure_future(client.post("/process", json=member("cr", "cr-0", 300)))
    await until(lambda: any(len(r.tokens) >= 3 for r in fake.running.values()))
    r = await asyncio.wait_for(client.post("/cancel", json={"job_id": "cr-0"}), 5)
    assert (await r.json())["cancelled"] is True
    assert (await (await asyncio.wait_for(slow, 5)).json())["failure_kind"] == "cancelled"
    other = await asyncio.wait_for(client.post("/process", json=member("cr", "cr-1", 20)), 10)
    assert (await other.json())["speed"] == 0.0  # one member left: no median to beat


@pytest.mark.parametrize("settings", [{"completion_time_wait_s": 60.0}], indirect=True)
async def test_a_weight_swap_dropping_a_stale_held_member_does_not_wait_for_its_group(flaky):
    """``max_staleness`` cancels a held member whose first turn is too old (the server's cancel: filtered, the
    trainer re-submits): the pause answers at once instead of after the group's wait."""
    client, fake = flaky
    assert (await client.post("/jobs", json=member("st", "st-0", 20))).status == 202
    await until(lambda: not fake.running and fake.counts["requests"] >= 1)
    await asyncio.sleep(0.2)
    assert (await state(client, "st-0"))["state"] != "done"  # held
    r = await asyncio.wait_for(client.post("/weights/pause", json={"weight_version": 2, "max_staleness": 1}), 10)
    paused = await r.json()
    assert paused["dropped_jobs"] == 1, paused
    result = (await state(client, "st-0"))["result"]
    assert result["failure_kind"] == "cancelled" and result["filter"] is True
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "weight_version": 2})
    assert r.status == 200, await r.text()
