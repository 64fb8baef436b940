"""Segments on every trajectory (#34 part 1): ``[start, end)`` spans of ``prompt_ids + response_ids`` with a
kind and a cumulative hash over the tokens and their provenance, so rows that look equal but were sampled
under other weights (or routed through other experts) never share a hash."""
from __future__ import annotations

import json

import pytest

from prorl_server.types import JobResult, Trajectory, segment_hash


def row(versions=((3, 3), (3, 2)), prompt=(1, 2, 3), **kw) -> Trajectory:
    # prompt 1 2 3 | sampled 10 11 12 | observation 20 21 | sampled 13 14
    return Trajectory(prompt_ids=list(prompt), response_ids=[10, 11, 12, 20, 21, 13, 14],
                      response_logprobs=[-.1, -.2, -.3, 0, 0, -.4, -.5], loss_mask=[1, 1, 1, 0, 0, 1, 1],
                      version_runs=[list(v) for v in versions], **kw)


def test_segments_tile_the_token_stream_by_kind():
    segs = row().segments
    assert [(s.start, s.end, s.kind) for s in segs] == [
        (0, 3, "prompt"), (3, 6, "sampled"), (6, 8, "observation"), (8, 10, "sampled")]
    assert len({s.hash for s in segs}) == 4 and all(len(s.hash) == 32 for s in segs)
    # the documented chain: each hash over the previous one, the kind, the tokens and their provenance
    t, h = row(), ""
    stream = t.prompt_ids + t.response_ids
    for s, provenance in zip(segs, [None, {"v": [[3, 3]], "r": None}, None, {"v": [[3, 2]], "r": None}]):
        h = segment_hash(h, s.kind, stream[s.start:s.end], provenance)
        assert s.hash == h


def test_segments_travel_on_the_wire_and_are_recomputed_not_trusted():
    t = row()
    wire = json.loads(JobResult(job_id="j", trajectory_id="t", handler="h", trajectories=[t]).model_dump_json())
    sent = wire["trajectories"][0]["segments"]
    assert [s["hash"] for s in sent] == [s.hash for s in t.segments]
    # a client gets the segments of the tokens it received, whatever hash came with them
    sent[0]["hash"] = "0" * 32
    wire["trajectories"][0]["prompt_ids"] = [1, 2, 4]
    back = JobResult.model_validate(wire).trajectories[0]
    assert back.segments[0].hash not in ("0" * 32, t.segments[0].hash)


def test_the_hash_is_cumulative_over_the_prefix():
    a, b = row(), row(prompt=(1, 2, 4))
    # same later tokens, another prompt: every later boundary differs too
    assert all(x.hash != y.hash for x, y in zip(a.segments, b.segments))
    assert [s.hash for s in row().segments] == [s.hash for s in a.segments]


def test_equal_tokens_sampled_under_other_weight_versions_hash_differently():
    a, b = row(versions=((3, 5),)), row(versions=((3, 3), (4, 2)))
    assert a.segments[0].hash == b.segments[0].hash and a.segments[1].hash == b.segments[1].hash
    assert a.segments[3].hash != b.segments[3].hash  # the last turn: version 3 vs 4
    c = row(versions=((3, 2), (4, 1), (4, 2)))  # the first turn crossed the swap
    assert c.segments[1].hash != a.segments[1].hash


def test_a_prompt_token_and_the_same_token_sampled_hash_differently():
    # the rewritten-context row: its prompt holds what an earlier row sampled
    earlier = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-.1, -.1], loss_mask=[1, 1],
                         version_runs=[[0, 2]])
    later = Trajectory(prompt_ids=[1, 2, 3, 4], response_ids=[5], response_logprobs=[-.1], loss_mask=[1],
                       version_runs=[[0, 1]])
    assert earlier.segments[1].end == later.segments[0].end == 4
    assert earlier.segments[1].hash != later.segments[0].hash


def test_routed_expert_records_enter_the_hash():
    # one route per row position (10 tokens; the last generated token has none): positions 8, 9 are the last turn
    routes_a = [[[0, 1]]] * 9
    routes_b = [[[0, 1]]] * 8 + [[[2, 3]]]
    a, b = row(routed_experts=routes_a), row(routed_experts=routes_b)
    assert a.segments[1].hash == b.segments[1].hash and a.segments[3].hash != b.segments[3].hash


async def test_a_conversation_trajectory_carries_segments_matching_its_loss_mask(tokenizer):
    from prorl_server.llm.client import Completion
    from prorl_server.llm.conversation import Conversation

    conv = Conversation(tokenizer, [{"role": "user", "content": "List the files."}], max_context_tokens=4096)
    for i in range(2):  # scripted generations standing for what vLLM returns
        ids = tokenizer.encode(f"Step {i}.", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        conv.add_completion(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                       stop_reason=None, backend="scripted", weight_versions=[7]))
        assert await conv.add_messages([{"role": "user", "content": f"go on {i}"}])
    (t,) = conv.trajectories()
    assert [s.kind for s in t.segments] == ["prompt", "sampled", "observation", "sampled", "observation"]
    P = len(t.prompt_ids)
    for s in t.segments[1:]:
        assert set(t.loss_mask[s.start - P:s.end - P]) == {1 if s.kind == "sampled" else 0}
    assert t.segments[-1].end == P + len(t.response_ids)


def test_token_ids_outside_int64_still_hash():
    big = Trajectory(prompt_ids=[2**70], response_ids=[1, 2**64], response_logprobs=[0.0, -1.0], loss_mask=[0, 1])
    other = Trajectory(prompt_ids=[2**70], response_ids=[1, 2**64 + 1], response_logprobs=[0.0, -1.0],
                       loss_mask=[0, 1])
    assert [s.kind for s in big.segments] == ["prompt", "observation", "sampled"]
    assert big.segments[-1].hash != other.segments[-1].hash


def test_the_openapi_schema_says_what_the_server_writes():
    from prorl_server.app import ROUTES
    from prorl_server.routes import openapi_schema

    schema = openapi_schema(ROUTES, data_sources=[])
    assert "segments" in schema["components"]["schemas"]["Trajectory"]["properties"]
    assert "/groups/{group_id}/tree" in schema["paths"] and "GroupTree" in schema["components"]["schemas"]


def test_a_run_cursor_reads_consecutive_spans_as_slicing_each_from_the_start_would():
    """RunCursor replaced a slice of the version runs from their start per segment (quadratic: one-token turns
    with a version each took 5.7 s for a 10k-token row, a red team's finding); the spans it gives are those."""
    import random

    from prorl_server.types import RunCursor

    def from_start(runs, start, n):  # the slicing it replaced, as it was
        out, pos = [], 0
        for v, c in runs:
            a, b = max(pos, start), min(pos + c, start + n)
            if a < b:
                if out and out[-1][0] == v:
                    out[-1][1] += b - a
                else:
                    out.append([v, b - a])
            pos += c
            if pos >= start + n:
                break
        return out

    rnd = random.Random(0)
    for _ in range(5000):
        runs = [[rnd.choice([None, 1, 2, 3]), rnd.randrange(0, 5)] for _ in range(rnd.randrange(0, 8))]
        cursor, pos, total = RunCursor(runs), 0, sum(c for _, c in runs) + rnd.randrange(0, 3)
        while pos < total:
            n = rnd.randrange(0, 4)
            assert cursor.take(n) == from_start(runs, pos, n), (runs, pos, n)
            pos += n
