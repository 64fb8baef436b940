"""Every malformed request is a 4xx with {error: {type, message, field?}}; never a 500, never a hang."""
from __future__ import annotations

import pytest

CASES = [
    # (method, path, raw body, status, error type, field)
    ("POST", "/process", b"{not json", 400, "invalid_json", None),
    ("POST", "/process", b"[1, 2]", 422, "validation_error", None),
    ("POST", "/process", b'{"sampling_params": {}}', 422, "validation_error", "instance"),
    ("POST", "/process", b'{"instance": "x"}', 422, "validation_error", "instance"),
    ("POST", "/process", b'{"instance": {}}', 422, "validation_error", "instance"),
    ("POST", "/process", b'{"instance": {"data_source": 5}}', 422, "validation_error", "instance"),
    ("POST", "/process", b'{"instance": {"data_source": "arithmetic"}, "timeout_s": -1}', 422,
     "validation_error", "timeout_s"),
    ("POST", "/process", b'{"instance": {"data_source": "arithmetic"}, "sampling_params": 3}', 422,
     "validation_error", "sampling_params"),
    ("POST", "/process", b'{"instance": {"data_source": "arithmetic"}, "surprise": 1}', 422,
     "validation_error", "surprise"),
    ("POST", "/jobs", b'{"instance": {"data_source": "no_such_handler"}}', 400, "unknown_handler",
     "instance.data_source"),
    # the handler's instance model, checked at submit: a malformed instance is never run
    ("POST", "/process", b'{"instance": {"data_source": "arithmetic"}}', 422, "validation_error",
     "instance.expression"),
    ("POST", "/jobs", b'{"instance": {"data_source": "calc", "expression": ["1"]}}', 422, "validation_error",
     "instance.expression"),
    ("POST", "/process", b'{"instance": {"data_source": "arithmetic", "expression": "1", "answer": "one"}}', 422,
     "validation_error", "instance.answer"),
    ("POST", "/jobs", b'{"instance": {"data_source": "arithmetic", "instance_id": "arith-1-99999"}}', 422,
     "validation_error", "instance.instance_id"),
    ("POST", "/cancel", b"{}", 422, "validation_error", "job_id"),
    ("POST", "/cancel", b"\n", 400, "invalid_json", None),  # whitespace is not JSON; only no body reads as {}
    ("POST", "/cancel", b'{"job_id": 7}', 422, "validation_error", "job_id"),
    ("POST", "/add_llm_server", b'{"address": "ftp://host:21"}', 422, "validation_error", "address"),
    ("POST", "/add_llm_server", b'{"address": "127.0.0.1:8000"}', 422, "validation_error", "address"),
    ("POST", "/add_llm_server", b'{"address": "http://x", "weight_version": "new"}', 422,
     "validation_error", "weight_version"),
    ("GET", "/jobs/unknown-id", None, 404, "unknown_job", None),
    ("GET", "/no/such/route", None, 404, "not_found", None),
    ("GET", "/process", None, 405, "method_not_allowed", None),
]


@pytest.mark.parametrize("method,path,body,status,etype,field", CASES,
                         ids=[f"{c[0]} {c[1]} {c[4]} {c[5]}" for c in CASES])
async def test_bad_request_gets_clear_json_error(make_client, method, path, body, status, etype, field):
    client = await make_client()
    r = await client.request(method, path, data=body, headers={"Content-Type": "application/json"})
    assert r.status == status
    err = (await r.json())["error"]
    assert err["type"] == etype
    assert err["message"]
    if field is not None:
        assert err["field"] == field


async def test_unknown_handler_error_lists_known_handlers(make_client):
    client = await make_client()
    r = await client.post("/process", json={"instance": {"data_source": "nope"}})
    msg = (await r.json())["error"]["message"]
    assert "arithmetic" in msg and "scripted" in msg


async def test_oversized_body_is_413(make_client):
    client = await make_client(max_body_mb=0.01)
    r = await client.post("/process", data=b'{"instance": {"data_source": "arithmetic", "x": "'
                          + b"a" * 20000 + b'"}}')
    assert r.status == 413
    assert (await r.json())["error"]["type"] == "body_too_large"


async def test_llm_job_without_backend_is_503_but_llm_free_job_runs(make_client):
    client = await make_client()
    r = await client.post("/process", json={"instance": {"data_source": "llm_holder"}})
    assert r.status == 503
    assert "add_llm_server" in (await r.json())["error"]["message"]
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "1"}})
    assert r.status == 200


async def test_duplicate_in_flight_job_id_is_409(make_client):
    client = await make_client()
    body = {"instance": {"data_source": "scripted", "sleep": {"run": 30}}, "job_id": "dup"}
    assert (await client.post("/jobs", json=body)).status == 202
    r = await client.post("/jobs", json=body)
    assert r.status == 409 and (await r.json())["error"]["field"] == "job_id"
    await client.post("/cancel", json={"job_id": "dup"})


async def test_token_required_everywhere_but_health(make_client):
    client = await make_client(token="s3cret")
    assert (await client.get("/health")).status == 200
    for method, path in [("GET", "/status"), ("POST", "/process"), ("GET", "/metrics"), ("POST", "/stop"),
                         ("GET", "/openapi.json"), ("POST", "/add_llm_server"), ("GET", "/no/such/path")]:
        r = await client.request(method, path)
        assert r.status == 401, path
        assert (await r.json())["error"]["type"] == "unauthorized"
    r = await client.get("/status", headers={"Authorization": "Bearer wrong"})
    assert r.status == 401
    r = await client.get("/status", headers={"Authorization": "Bearer s3cret"})
    assert r.status == 200


async def test_openapi_is_generated_from_wire_models(make_client):
    client = await make_client()
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    proc = doc["paths"]["/process"]["post"]
    assert proc["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ProcessRequest")
    schemas = doc["components"]["schemas"]
    assert {"ProcessRequest", "JobResult", "Trajectory", "ErrorResponse"} <= set(schemas)
    assert schemas["JobResult"]["properties"]["reward"]["type"] == "number"
    assert "/jobs/{job_id}" in doc["paths"] and "/cancel" in doc["paths"]
    assert doc["paths"]["/jobs/{job_id}"]["get"]["parameters"][0]["name"] == "job_id"
    # the gateway's routes are listed too: agent routes take the capability in the path, not the bearer token
    chat = doc["paths"]["/sessions/{ref}/v1/chat/completions"]["post"]
    assert chat["security"] == [] and [p["name"] for p in chat["parameters"]] == ["ref"]
    assert "OpenAI format" in chat["responses"]["4XX"]["description"]
    assert doc["paths"]["/sessions/{session_id}/finalize"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
