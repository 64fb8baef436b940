"""The aiohttp application: ``create_app(settings)`` factory, routes, error and auth middlewares.

The route table ``ROUTES`` is the one list of endpoints: it registers the handlers and generates
``/openapi.json`` from the pydantic models in :mod:`prorl_server.types`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Optional, Type

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from handlers.registry import HandlerRegistry, UnknownHandlerError, default_registry
from prorl_server.balancer import BackendPool, NoBackendError
from prorl_server.config import ServerSettings
from prorl_server.cpu_pool import DEFAULT_WORKERS, CpuPool
from prorl_server.llm_context import LLMContext
from prorl_server.loop_monitor import LoopLagMonitor
from prorl_server.metrics import Metrics
from prorl_server.pipeline import DuplicateJobError, Pipeline, ServerStoppedError
from prorl_server.types import (AddBackendRequest, CancelRequest, CancelResponse, ErrorDetail, ErrorResponse,
                                JobResult, JobStatusResponse, OkResponse, ProcessRequest, StatusResponse,
                                SubmitResponse)

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", ServerSettings)
PIPELINE = web.AppKey("pipeline", Pipeline)
POOL = web.AppKey("pool", BackendPool)
METRICS = web.AppKey("metrics", Metrics)
REGISTRY = web.AppKey("registry", HandlerRegistry)
RUNTIME = web.AppKey("sandbox_runtime", object)
CPU_POOL = web.AppKey("cpu_pool", CpuPool)
LOOP_MONITOR = web.AppKey("loop_monitor", LoopLagMonitor)


class ApiError(Exception):
    """An error answered as ``{error: {type, message, field?}}`` with HTTP ``status``."""

    def __init__(self, status: int, type_: str, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.field = status, type_, message, field


def json_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=model.model_dump_json(), status=status, content_type="application/json")


def error_response(status: int, type_: str, message: str, field: Optional[str] = None) -> web.Response:
    return json_response(ErrorResponse(error=ErrorDetail(type=type_, message=message, field=field)), status)


async def parse_body(request: web.Request, model: Type[BaseModel]) -> Any:
    """Validate the JSON body against ``model``. Raises ApiError 400 (not JSON) or 422 (wrong shape)."""
    body = await request.read()
    if not body.strip():
        body = b"{}"
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, "invalid_json", f"request body is not valid JSON: {err['msg']}") from None
        field = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(422, "validation_error", f"{field or 'body'}: {err['msg']}", field) from None


# ------------------------------------------------------------------------------------------ middlewares


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.type, e.message, e.field)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(e.status, "http_error")
        resp = error_response(e.status, kind, e.text or e.reason)
        if "Allow" in e.headers:  # RFC 9110: a 405 says which methods the resource has
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug; still answer in the contract's shape
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")


def auth_middleware(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        # The route table says who needs the token: "none" (/health) and "capability" (the gateway's agent
        # routes, whose handlers check the secret in their path) do not; unknown paths do.
        route = request.app[APP_ROUTES].get(request.match_info.handler)
        if route is None or route.auth == "bearer":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(401, "unauthorized", "missing or wrong bearer token "
                                      "(send 'Authorization: Bearer <token>')")
        return await handler(request)

    return check


# ------------------------------------------------------------------------------------------ handlers


async def process(request: web.Request) -> web.Response:
    """Submit a job and block until it ends; answers the JobResult (ProRL-compatible)."""
    job = _submit(request, await parse_body(request, ProcessRequest))
    response = json_response(await asyncio.shield(job.done))
    request.app[PIPELINE].delivered(job)  # its client has it: GET /jobs/{id} keeps a summary only
    return response


async def submit_job(request: web.Request) -> web.Response:
    """Submit a job and return at once with its id (poll ``GET /jobs/{job_id}``)."""
    job = _submit(request, await parse_body(request, ProcessRequest))
    return json_response(SubmitResponse(job_id=job.job_id), status=202)


def _submit(request: web.Request, req: ProcessRequest):
    try:
        return request.app[PIPELINE].submit(req)
    except UnknownHandlerError as e:
        raise ApiError(400, "unknown_handler", str(e), "instance.data_source") from None
    except NoBackendError as e:
        raise ApiError(503, "no_backend", str(e)) from None
    except ServerStoppedError as e:
        raise ApiError(503, "stopped", str(e)) from None
    except DuplicateJobError as e:
        raise ApiError(409, "duplicate_job", str(e), "job_id") from None


async def get_job(request: web.Request) -> web.Response:
    job_id = request.match_info["job_id"]
    job = request.app[PIPELINE].get(job_id)
    if job is None:
        raise ApiError(404, "unknown_job", f"no job with id {job_id!r} (never submitted, or expired)")
    return json_response(JobStatusResponse(job_id=job_id, state=job.status, result=job.result))


async def cancel(request: web.Request) -> web.Response:
    req = await parse_body(request, CancelRequest)
    try:
        cancelled, state = await request.app[PIPELINE].cancel(req.job_id)
    except KeyError:
        raise ApiError(404, "unknown_job", f"no job with id {req.job_id!r}", "job_id") from None
    return json_response(CancelResponse(job_id=req.job_id, cancelled=cancelled, state=state))


async def add_llm_server(request: web.Request) -> web.Response:
    req = await parse_body(request, AddBackendRequest)
    request.app[POOL].add(req.address, req.weight_version)
    return json_response(OkResponse(detail=f"backend {req.address} registered"))


async def clear_llm_server(request: web.Request) -> web.Response:
    """Take every backend out of the rotation (a weight update); re-adding an address revives the same backend
    with its new version, and jobs submitted meanwhile wait up to ``backend_wait_s``."""
    n = request.app[POOL].clear()
    return json_response(OkResponse(detail=f"{n} backend(s) removed"))


async def start(request: web.Request) -> web.Response:
    request.app[PIPELINE].resume()
    return json_response(OkResponse(detail="accepting jobs"))


async def stop(request: web.Request) -> web.Response:
    n = await request.app[PIPELINE].stop()
    return json_response(OkResponse(detail=f"stopped; {n} job(s) cancelled; POST /start to resume"))


async def status(request: web.Request) -> web.Response:
    p = request.app[PIPELINE]
    return json_response(StatusResponse(
        accepting=p.accepting, stages=p.stage_status(), jobs_in_flight=p.in_flight,
        backends=[b.info() for b in request.app[POOL].backends], handlers=request.app[REGISTRY].names()))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_schema(request.app[APP_ROUTES].values(),
                                            data_sources=request.app[REGISTRY].names()))


@dataclass(frozen=True)
class Route:
    """One endpoint: registered on the app and described in ``/openapi.json``. ``auth``: ``"bearer"`` (the
    server token, when one is configured), ``"capability"`` (a secret in the path; the gateway's agent
    routes) or ``"none"``. ``openai_errors``: errors answer in the OpenAI format (the gateway's routes), not
    as :class:`ErrorResponse`. ``status``: the success status the handler answers with ``response``;
    ``errors``: 5xx statuses it can answer by design (``503`` no backend / stopped), besides every 4xx."""

    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    summary: str
    request: Optional[Type[BaseModel]] = None
    response: Optional[Type[BaseModel]] = None
    auth: str = "bearer"
    openai_errors: bool = False
    status: int = 200
    errors: tuple[int, ...] = ()


ROUTES: tuple[Route, ...] = (
    Route("POST", "/process", process, "Run a job and wait for its result", ProcessRequest, JobResult,
          errors=(503,)),
    Route("POST", "/jobs", submit_job, "Submit a job without waiting", ProcessRequest, SubmitResponse,
          status=202, errors=(503,)),
    Route("GET", "/jobs/{job_id}", get_job, "State of a job, with its result once done", None,
          JobStatusResponse),
    Route("POST", "/cancel", cancel, "Cancel a job (idempotent)", CancelRequest, CancelResponse),
    Route("POST", "/add_llm_server", add_llm_server, "Register an LLM backend (idempotent)",
          AddBackendRequest, OkResponse),
    Route("POST", "/clear_llm_server", clear_llm_server, "Take every LLM backend out of the rotation (re-adding "
          "an address revives it with its new weight_version)", None, OkResponse),
    Route("POST", "/start", start, "Accept jobs again after /stop", None, OkResponse),
    Route("POST", "/stop", stop, "Refuse new jobs and cancel in-flight ones", None, OkResponse),
    Route("GET", "/status", status, "Queues, active jobs and backends", None, StatusResponse),
    Route("GET", "/health", health, "Liveness (no auth)", auth="none"),
    Route("GET", "/metrics", metrics, "Prometheus metrics (text format)"),
    Route("GET", "/openapi.json", openapi, "This API's OpenAPI 3.1 schema"),
)


#: The routes of an app by handler: ``ROUTES`` plus those added by extensions (the gateway's). The auth
#: middleware reads each route's ``auth`` here; ``/openapi.json`` lists them.
APP_ROUTES = web.AppKey("app_routes", dict)


def add_routes(app: web.Application, routes: Iterable[Route]) -> None:
    """Register ``routes`` on ``app``: served, authorized as their ``auth`` says, listed in ``/openapi.json``."""
    for r in routes:
        app.router.add_route(r.method, r.path, r.handler)
        app[APP_ROUTES][r.handler] = r


def openapi_schema(routes: Iterable[Route] = ROUTES, data_sources: Optional[list[str]] = None) -> dict[str, Any]:
    """OpenAPI 3.1 document generated from ``routes`` and their pydantic models; ``data_sources``: the
    handler names and aliases this server serves (``instance.data_source`` is one of them)."""
    routes = list(routes)
    models = {m for r in routes for m in (r.request, r.response) if m is not None} | {ErrorResponse}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")

    def ref(m: Type[BaseModel]) -> dict[str, Any]:
        return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{m.__name__}"}}}}

    paths: dict[str, Any] = {}
    for r in routes:
        error = ({"description": "Error in the OpenAI format {error: {message, type, param, code}}"}
                 if r.openai_errors else {"description": "Error", **ref(ErrorResponse)})
        op: dict[str, Any] = {"summary": r.summary, "responses": {
            str(r.status): {"description": "OK", **(ref(r.response) if r.response else {})}, "4XX": error,
            **{str(code): error for code in r.errors}}}
        if r.request is not None:
            op["requestBody"] = {"required": True, **ref(r.request)}
        params = re.findall(r"{(\w+)}", r.path)
        if params:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in params]
        op["security"] = [{"bearer": []}] if r.auth == "bearer" else []
        paths.setdefault(r.path, {})[r.method.lower()] = op
    instance = defs.get("$defs", {}).get("ProcessRequest", {}).get("properties", {}).get("instance")
    if instance is not None and data_sources is not None:
        instance["properties"]["data_source"]["enum"] = sorted(data_sources)
    return {"openapi": "3.1.0", "info": {"title": "ProRL rollout server", "version": "0.1.0"},
            "paths": paths, "components": {"schemas": defs.get("$defs", {}),
                                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


# ------------------------------------------------------------------------------------------ factory


def create_app(settings: Optional[ServerSettings] = None, registry: Optional[HandlerRegistry] = None,
               sandbox_runtime: Any = None) -> web.Application:
    """Build the rollout server application.

    Args:
        settings: server settings (defaults if None).
        registry: handlers to serve; default: the process-wide registry plus every entry-point handler.
        sandbox_runtime: a ready ``sandbox`` runtime to use instead of building one from
            ``settings.sandbox_runtime`` (tests inject one).
    """
    settings = settings or ServerSettings()
    if registry is None:
        registry = default_registry
        registry.load_entry_points()
    middlewares = [error_middleware]
    if settings.token:
        middlewares.append(auth_middleware(settings.token))
    app = web.Application(middlewares=middlewares, client_max_size=int(settings.max_body_mb * 1024 * 1024))
    m = Metrics()
    pool = BackendPool(on_change=m.backend_changed, affinity_slack=settings.affinity_slack,
                       on_affinity=m.affinity_decided)
    for address in settings.backends:
        pool.add(AddBackendRequest(address=address).address)
    app[SETTINGS], app[METRICS], app[POOL], app[REGISTRY] = settings, m, pool, registry
    app[RUNTIME] = sandbox_runtime
    app[APP_ROUTES] = {}
    add_routes(app, ROUTES)
    app.cleanup_ctx.append(_loop_monitor_ctx)
    app.cleanup_ctx.append(_sandbox_ctx)
    app.cleanup_ctx.append(_cpu_pool_ctx)  # before the pipeline: closed after it, when no job scores anymore
    app.cleanup_ctx.append(_pipeline_ctx)
    app.cleanup_ctx.append(_health_ctx)
    from prorl_server.gateway import setup_gateway  # noqa: E402 (the gateway imports this module)
    setup_gateway(app, max_sessions=settings.gateway_max_sessions, idle_timeout_s=settings.gateway_idle_timeout_s,
                  keep_finished=settings.gateway_keep_finished, parser=settings.gateway_tool_parser)
    return app


async def _sandbox_ctx(app: web.Application):
    settings = app[SETTINGS]
    own = False
    if app[RUNTIME] is None and settings.sandbox_runtime:
        from sandbox import make_runtime

        app[RUNTIME] = make_runtime(settings.sandbox_runtime, **settings.sandbox_options)
        own = True
    runtime = app[RUNTIME]
    if runtime is not None and own:
        reaped = await runtime.reap_orphans()
        if reaped:
            log.warning("reaped %d sandbox(es) left by a crashed earlier server", reaped)
    yield
    if runtime is not None:
        await runtime.close_all()


async def _loop_monitor_ctx(app: web.Application):
    m = app[METRICS]
    monitor = app[LOOP_MONITOR] = LoopLagMonitor(histogram=m.event_loop_lag, max_gauge=m.event_loop_lag_max)
    monitor.start()
    yield
    await monitor.stop()


async def _cpu_pool_ctx(app: web.Application):
    # Workers start on first use: a server that never scores a CPU-heavy answer never starts one.
    tasks = app[METRICS].cpu_tasks
    pool = app[CPU_POOL] = CpuPool(app[SETTINGS].cpu_workers or DEFAULT_WORKERS,
                                   on_outcome=lambda outcome: tasks.labels(outcome).inc())
    yield
    await pool.close()


async def _pipeline_ctx(app: web.Application):
    settings = app[SETTINGS]
    runtime = app[RUNTIME]
    opener = None
    if runtime is not None:
        async def opener(spec=None, **kw):
            from sandbox import SandboxSpec

            spec = spec if spec is not None else SandboxSpec(**kw)
            if spec.image is None and settings.sandbox_image:
                spec.image = settings.sandbox_image
            return await runtime.start(spec)
    llm = LLMContext(app[POOL], tokenizer=settings.tokenizer, request_timeout_s=settings.llm_timeout_s)
    pipeline = Pipeline(app[REGISTRY], app[POOL], app[METRICS], settings.workers(),
                        default_timeout_s=settings.default_timeout_s, backend_wait_s=settings.backend_wait_s,
                        keep_finished=settings.keep_finished, keep_finished_mb=settings.keep_finished_mb,
                        sandbox_opener=opener, llm=llm,
                        cpu_pool=app[CPU_POOL])
    app[PIPELINE] = pipeline
    pipeline.start_workers()
    app.on_shutdown.append(_cancel_jobs_on_shutdown)
    yield
    await pipeline.shutdown()
    await llm.close()


async def _cancel_jobs_on_shutdown(app: web.Application) -> None:
    # on_shutdown runs before the runner waits for open requests: a blocking /process answers its client the
    # cancelled result now instead of the server waiting (up to its shutdown timeout) for the job to end.
    await app[PIPELINE].shutdown()


async def _health_ctx(app: web.Application):
    settings = app[SETTINGS]
    session = aiohttp.ClientSession()
    task = asyncio.create_task(app[POOL].probe_forever(session, settings.health_interval_s))
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await session.close()


def write_ready_file(path: str, host: str, port: int) -> None:
    """Atomically write ``{host, port, pid, url}`` to ``path`` (launchers wait for it)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"host": host, "port": port, "pid": os.getpid(), "url": f"http://{host}:{port}"}, f)
    os.replace(tmp, path)
