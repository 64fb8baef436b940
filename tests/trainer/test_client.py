"""The rollout client against real rollout servers (the project's app on loopback TCP, over HTTP)."""
from __future__ import annotations

import asyncio
import json

import pytest

from prorl_server.plugin.handler import AgentHandler
from trainer_plugins.admission import DropStale, WaitForStale, WindowedFIFO
from trainer_plugins.client import RolloutClient
from trainer_plugins.servers import ServerEntry, write_servers


def item(i, rewards=(0, 1), sleeps=(0,)):
    return {"data_source": "varied", "id": f"p{i}", "rewards": list(rewards), "sleeps": list(sleeps)}


async def drain(client, limit=100):
    batches = []
    for _ in range(limit):
        try:
            batches.append(await client.next_batch())
        except StopAsyncIteration:
            return batches
        await client.update_weights(register=False)
    raise AssertionError("the dataset never ran out")


async def test_replenishment_walks_every_epoch_not_the_first_batch_again(start_server, varied):
    url = await start_server()
    data = [item(i) for i in range(3)]
    async with RolloutClient([url], data, groups_per_step=2, n_samples=2, max_epochs=2, shuffle=True,
                             seed=1, max_staleness=None) as client:
        batches = await drain(client)
    uids = [g.uid for b in batches for g in b.groups]
    assert sorted(uids) == sorted(f"e{e}-i{i}" for e in (0, 1) for i in range(3))
    assert [b.metrics.groups for b in batches] == [2, 2, 2]
    assert sum(varied.started.values()) == 12  # 3 prompts x 2 epochs x 2 samples, nothing resubmitted


async def test_early_termination_cancels_unneeded_jobs_on_the_server(start_server, varied, job_state):
    url = await start_server()
    data = [item(0), item(1, sleeps=(30,)), item(2, sleeps=(30,))]
    client = RolloutClient([url], data, groups_per_step=1, n_samples=2, max_staleness=0, oversubscribe=2,
                           max_epochs=1, job_prefix="et")
    async with client:
        for _ in range(200):  # all three groups submitted (the slow ones are running)
            if len(varied.seen) == 6:
                break
            await asyncio.sleep(0.02)
        batch = await asyncio.wait_for(client.next_batch(), 10)
        assert [g.uid for g in batch.groups] == ["e0-i0"]
        assert batch.metrics.cancelled_jobs == 4 and batch.metrics.stale_groups == 2
        slow = [j for j in varied.seen if "-i0-" not in j]
        for jid in slow:
            for _ in range(200):
                s = await job_state(url, jid)
                if s["state"] == "done":
                    break
                await asyncio.sleep(0.02)
            assert s["state"] == "done" and s["result"]["critical_error"] == "cancelled", s
    assert len(slow) == 4


async def test_without_carry_over_unfinished_groups_are_cancelled_every_step(start_server, varied):
    url = await start_server()
    data = [item(0, sleeps=(0, 30)), item(1)]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=2, max_staleness=1,
                             carry_over=False, max_epochs=1) as client:
        batch = await asyncio.wait_for(client.next_batch(), 10)
    assert [g.uid for g in batch.groups] == ["e0-i1"]
    assert batch.metrics.cancelled_jobs == 1 and batch.metrics.carried_groups == 0


async def test_carry_over_keeps_finished_siblings_of_incomplete_groups(start_server, varied):
    url = await start_server()
    data = [item(0, sleeps=(0, 1.0)), item(1)]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=2, max_staleness=1,
                             max_epochs=1) as client:
        first = await asyncio.wait_for(client.next_batch(), 10)
        assert [g.uid for g in first.groups] == ["e0-i1"]
        assert first.metrics.carried_groups == 1
        assert first.metrics.carried_finished_jobs == 1 and first.metrics.carried_inflight_jobs == 1
        carried = client.queue.get(client.queue.head)
        finished_before = [s.job_id for s in carried.samples if s.done]
        await client.update_weights(register=False)
        second = await asyncio.wait_for(client.next_batch(), 10)
    (g,) = second.groups
    assert g.uid == "e0-i0" and sorted(g.rewards) == [0.0, 1.0]
    assert finished_before[0] in [r.job_id for r in g.results]  # the sibling was kept, not rerun
    assert varied.started["p0"] == 2
    assert second.metrics.lag == [1]


async def test_all_equal_groups_are_dropped_and_counted(start_server):
    url = await start_server()
    data = [item(0, rewards=(1, 1)), item(1), item(2, rewards=(0, 0)), item(3)]
    async with RolloutClient([url], data, groups_per_step=2, n_samples=2, max_staleness=None,
                             max_epochs=1) as client:
        batch = await asyncio.wait_for(client.next_batch(), 10)
    assert sorted(g.uid for g in batch.groups) == ["e0-i1", "e0-i3"]
    assert batch.metrics.dropped_groups == 2
    assert batch.metrics.mean_reward == 0.5


@pytest.mark.parametrize("window", [1, 2, None])
async def test_windowed_fifo_never_hands_out_a_group_outside_the_window(start_server, window):
    url = await start_server()
    # later prompts finish first: greedy takes them out of order, FIFO waits for the head
    data = [{"data_source": "varied", "id": f"p{i}", "sleeps": [(6 - i) * 0.12]} for i in range(6)]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=1, window=window,
                             dynamic_sampling=False, max_staleness=None, max_outstanding_groups=6,
                             max_epochs=1) as client:
        order = [b.groups[0].index for b in await drain(client)]
    assert sorted(order) == list(range(6))
    for k, idx in enumerate(order):
        head = min(set(range(6)) - set(order[:k]))
        assert window is None or idx - head < window, (order, k)
    if window == 1:
        assert order == list(range(6))
    if window is None:
        assert order[0] != 0  # greedy really took a later group first (so the bound above can fail)


def test_window_refuses_a_ready_item_outside_it():
    q = WindowedFIFO(2)
    a, b, c = q.push("a"), q.push("b"), q.push("c")
    q.mark_ready(c)
    assert q.takeable() == []
    with pytest.raises(ValueError):
        q.take(c)
    q.mark_ready(b)
    assert q.take(b) == "b"
    assert q.takeable() == []  # taking b does not slide the window: c is still outside
    q.remove(a)
    assert q.take(c) == "c"


@pytest.mark.parametrize("policy", ["drop", "wait"])
async def test_staleness_bound_holds_when_versions_advance_mid_step(start_server, varied, policy):
    url = await start_server()
    data = [item(0, sleeps=(0, 1.5))] + [item(i) for i in range(1, 5)]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=2, max_staleness=1,
                             staleness_policy=policy, max_epochs=1) as client:
        batches = [await asyncio.wait_for(client.next_batch(), 10)]
        assert "e0-i0" not in [g.uid for g in batches[0].groups]
        await client.update_weights(register=False)
        await client.update_weights(register=False)  # two versions in one step: e0-i0 now has lag 2
        assert len(client.queue) <= client.capacity
        while True:
            try:
                batches.append(await asyncio.wait_for(client.next_batch(), 10))
            except StopAsyncIteration:
                break
            await client.update_weights(register=False)
    lags = [lag for b in batches for lag in b.metrics.lag]
    assert max(lags) <= 1
    uids = [g.uid for b in batches for g in b.groups]
    stale = sum(b.metrics.stale_groups for b in batches)
    assert stale >= 1
    if policy == "drop":
        assert "e0-i0" not in uids
    else:
        assert "e0-i0" in uids and varied.started["p0"] >= 4  # regenerated at the new version
        assert sum(b.metrics.regenerated_groups for b in batches) == stale


# a policy is given by its configuration name or as the object itself
@pytest.mark.parametrize("policy", ["drop", "wait", DropStale(), WaitForStale()], ids=str)
async def test_a_slow_group_at_the_bound_is_dropped_or_waited_for(start_server, varied, policy):
    policy_name = getattr(policy, "name", policy)
    url = await start_server()
    data = [item(0, sleeps=(0, 1.0))] + [item(i) for i in range(1, 6)]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=2, max_staleness=1,
                             staleness_policy=policy, max_epochs=1) as client:
        first = await asyncio.wait_for(client.next_batch(), 10)
        assert first.groups[0].uid != "e0-i0"
        await client.update_weights(register=False)
        second = await asyncio.wait_for(client.next_batch(), 10)
    if policy_name == "wait":  # the step waited for the slow group rather than take a fresh one
        assert [g.uid for g in second.groups] == ["e0-i0"] and second.metrics.lag == [1]
        assert second.metrics.waited_groups == 1 and second.metrics.stale_groups == 0
    else:  # a fresh group was taken; the slow one could not be used next step, so it was cancelled
        assert second.groups[0].uid != "e0-i0"
        assert second.metrics.stale_groups == 1 and second.metrics.cancelled_jobs == 1
    assert varied.started["p0"] == 2


async def test_rollout_side_stops_submitting_at_the_staleness_bound(start_server, varied):
    url = await start_server()
    data = [item(i) for i in range(50)]
    async with RolloutClient([url], data, groups_per_step=2, n_samples=2, max_staleness=1) as client:
        await client.start()
        await asyncio.sleep(0.5)
        assert sum(varied.started.values()) == 2 * 2 * 2  # (K + 1) * B groups, n jobs each
        await client.next_batch()
        await asyncio.sleep(0.3)
        # a group submitted now would be consumed at version 2 at the earliest: lag 2 > K
        assert sum(varied.started.values()) == 2 * 2 * 2
        await client.update_weights(register=False)
        await asyncio.sleep(0.3)
        assert sum(varied.started.values()) == 2 * 2 * 3  # the weights advanced: B more groups


async def test_servers_json_same_node_first_and_backends_registered_everywhere(start_server, tmp_path):
    urls = [await start_server(), await start_server()]
    entries = [ServerEntry(url=u, node=node, host="127.0.0.1", port=int(u.rsplit(":", 1)[1]),
                           llm_backends=(f"http://127.0.0.{k + 2}:8000",))
               for k, (u, node) in enumerate(zip(urls, ["node-a", "node-b"]))]
    path = write_servers(tmp_path / "servers.json", "42", None, entries)
    data = [item(i) for i in range(4)]
    async with RolloutClient(path, data, groups_per_step=2, n_samples=2, local_node="node-b",
                             max_staleness=0, max_epochs=1) as client:
        assert client.urls == [urls[1], urls[0]]
        batch = await asyncio.wait_for(client.next_batch(), 10)
        servers = [s.server for g in batch.groups for s in g.samples]
        assert servers[0] == urls[1]  # same node first
        assert sorted(servers) == sorted(urls * 2)  # then round-robin
        await client.update_weights(7)
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for k, u in enumerate(urls):
                async with s.get(f"{u}/status") as r:
                    backends = (await r.json())["backends"]
                assert [(b["address"], b["weight_version"]) for b in backends] == [(f"http://127.0.0.{k + 2}:8000", 7)]
    assert json.loads(path.read_text())["job_id"] == "42"


@pytest.mark.real
async def test_weight_versions_come_from_the_backends_the_client_registered(start_llm_server, vllm_server):
    url = await start_llm_server()  # no backend until the client registers one
    data = [{"data_source": "chat", "messages": [{"role": "user", "content": f"Say {k}."}], "answer": str(k)}
            for k in range(4)]
    # window=1 (strict FIFO): the second step takes the group submitted second, at version 5, whichever of the
    # outstanding groups vLLM finishes first (greedy taking made the version below depend on that race)
    async with RolloutClient([url], data, groups_per_step=1, n_samples=2, dynamic_sampling=False, window=1,
                             max_staleness=1, sampling_params={"temperature": 1.0, "max_tokens": 8},
                             initial_weight_version=4, max_epochs=1) as client:
        await client.update_weights(5, backends=[vllm_server.address])
        first = await asyncio.wait_for(client.next_batch(), 120)
        await client.update_weights(6, backends=[vllm_server.address])
        second = await asyncio.wait_for(client.next_batch(), 120)
    for g in first.groups + second.groups:
        for r in g.results:
            assert r.critical_error is None, r.error
            assert r.weight_version in (5, 6)
            assert all(t.weight_versions == [r.weight_version] for t in r.trajectories)
            assert r.trajectories[0].response_ids
    assert first.metrics.lag == [0]
    # submitted while version 5 was registered: the server generated it with 5 and the lag says so
    assert second.groups[0].version == 5 and second.metrics.lag == [1]


# ------------------------------------------------------------------------------------------ filtered samples
class DyingSandboxHandler(AgentHandler):
    """Fault injection standing for a task handler whose sandbox dies: the first ``fail_first`` jobs of an
    instance id (in arrival order) raise the :class:`sandbox.errors.SandboxDeadError` a dead bubblewrap
    sandbox raises, so the server answers ``critical_error="run"``, ``failure_kind="sandbox"``,
    ``filter: true``; the later ones sleep ``sleep`` seconds in run and succeed with ``rewards[i % len]``
    (i = how many have succeeded before)."""

    name = "dying_sandbox"
    needs_llm = False

    def __init__(self):
        from collections import Counter

        self.started, self.succeeded, self.seen = Counter(), Counter(), []

    async def init(self, job):
        key = str(job.instance["id"])
        job.state["k"] = self.started[key]
        self.started[key] += 1
        self.seen.append(job.job_id)

    async def run(self, job):
        from sandbox.errors import SandboxDeadError

        if job.state["k"] < job.instance.get("fail_first", 0):
            raise SandboxDeadError("sandbox bwrap-1234: its processes are gone while running bash")
        await asyncio.sleep(job.instance.get("sleep", 0))

    async def eval(self, job):
        key = str(job.instance["id"])
        rewards = job.instance.get("rewards") or [0.0, 1.0]
        job.reward = float(rewards[self.succeeded[key] % len(rewards)])
        self.succeeded[key] += 1


@pytest.fixture
def dying():
    return DyingSandboxHandler()


@pytest.fixture
def start_dying_server(serve_handlers, dying):
    async def start():
        return await serve_handlers(dying)

    return start


def dying_item(i, fail_first, rewards=(0, 1), sleep=0):
    return {"data_source": "dying_sandbox", "id": f"p{i}", "fail_first": fail_first, "rewards": list(rewards),
            "sleep": sleep}


async def test_a_filtered_sample_is_regenerated_and_never_trained_on(start_dying_server, dying):
    url = await start_dying_server()
    async with RolloutClient([url], [dying_item(0, fail_first=1)], groups_per_step=1, n_samples=2,
                             max_staleness=None, max_epochs=1, job_prefix="rg") as client:
        batch = await asyncio.wait_for(client.next_batch(), 30)
    (g,) = batch.groups
    assert sorted(g.rewards) == [0.0, 1.0]
    assert all(r.filter is False and r.failure_kind is None for r in g.results)
    failed = [j for j in dying.seen if j not in [r.job_id for r in g.results]]
    assert len(failed) == 1 and len(dying.seen) == 3  # the failed job's result is not in the group
    assert any(r.job_id.endswith("-r1") for r in g.results)  # its regeneration is
    m = batch.metrics
    assert (m.filtered_jobs, m.samples_regenerated, m.groups_dropped_filtered) == (1, 1, 0)
    assert m.failure_kinds == {"sandbox": 1} and m.submitted_jobs == 3
    assert m.as_dict()["failure_kinds"] == {"sandbox": 1}


async def test_an_expired_sample_is_never_regenerated_and_its_group_is_dropped(aiohttp_server):
    # 410 result_expired: the job ran and its result was answered once (a server's journal has since deleted
    # it): a finished sample, not trained on again and never regenerated (a new job would be a second sample)
    from aiohttp import web

    from prorl_server.types import JobResult

    seen = []

    async def process(request):
        body = await request.json()
        seen.append(body["job_id"])
        if body["instance"]["id"] == "p0":
            return web.json_response({"error": {"type": "result_expired", "message": "deleted by retention"}},
                                     status=410)
        return web.json_response(JobResult(job_id=body["job_id"], trajectory_id=body["job_id"], handler="x",
                                           reward=1.0).model_dump(mode="json"))

    app = web.Application()
    app.router.add_post("/process", process)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    data = [{"data_source": "x", "id": "p0"}, {"data_source": "x", "id": "p1"}]
    async with RolloutClient([url], data, groups_per_step=1, n_samples=1, window=1, dynamic_sampling=False,
                             max_staleness=None, max_epochs=1, max_sample_retries=2) as client:
        batch = await asyncio.wait_for(client.next_batch(), 30)
    assert [g.uid for g in batch.groups] == ["e0-i1"]
    assert len(seen) == 2  # p0 once, p1 once: the expired sample was not regenerated
    assert batch.metrics.failure_kinds == {"expired": 1} and batch.metrics.samples_regenerated == 0


async def test_a_sample_that_stays_filtered_drops_its_group_and_the_step_goes_on(start_dying_server, dying):
    url = await start_dying_server()
    data = [dying_item(0, fail_first=10**6), dying_item(1, fail_first=0, rewards=(1,))]
    # window=1: the healthy group can be taken only once the failing one ahead of it is gone, so this step's
    # metrics hold every attempt of the failing group
    async with RolloutClient([url], data, groups_per_step=1, n_samples=1, window=1, dynamic_sampling=False,
                             max_staleness=None, max_epochs=1, max_sample_retries=2) as client:
        batch = await asyncio.wait_for(client.next_batch(), 30)
        with pytest.raises(StopAsyncIteration):  # nothing left, nothing hangs
            await asyncio.wait_for(client.next_batch(), 30)
    assert [g.uid for g in batch.groups] == ["e0-i1"]
    m = batch.metrics
    assert (m.filtered_jobs, m.samples_regenerated, m.groups_dropped_filtered) == (3, 2, 1)
    assert m.failure_kinds == {"sandbox": 3} and m.failed_jobs == 3
    assert dying.started["p0"] == 3  # the first job and max_sample_retries regenerations, no more


async def test_when_a_sample_stays_filtered_its_running_siblings_are_cancelled(start_dying_server, dying,
                                                                               job_state):
    url = await start_dying_server()
    async with RolloutClient([url], [dying_item(0, fail_first=1, sleep=60)], groups_per_step=1, n_samples=2,
                             max_staleness=None, max_epochs=1, max_sample_retries=0, job_prefix="sib") as client:
        with pytest.raises(StopAsyncIteration):  # the only group was dropped: nothing to wait for
            await asyncio.wait_for(client.next_batch(), 30)
        assert dying.started["p0"] == 2  # no regeneration with max_sample_retries=0
    states = [await job_state(url, j) for j in dying.seen]  # closing the client finished its cancels
    outcomes = sorted((st["result"]["critical_error"], st["result"]["failure_kind"]) for st in states)
    assert outcomes == [("cancelled", "cancelled"), ("run", "sandbox")]
