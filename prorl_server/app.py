"""The aiohttp application: ``create_app(settings)`` factory, routes, error and auth middlewares.

The route table ``ROUTES`` is the one list of endpoints: it registers the handlers and generates
``/openapi.json`` from the pydantic models in :mod:`prorl_server.types`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Optional

import aiohttp
from aiohttp import web

from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError, default_registry
from prorl_server.balancer import BackendPool, NoBackendError
from prorl_server.config import ServerSettings
from prorl_server.cpu_pool import DEFAULT_WORKERS, CpuPool
from prorl_server.llm_context import LLMContext
from prorl_server.loop_monitor import LoopLagMonitor
from prorl_server.metrics import Metrics
from prorl_server.pipeline import DuplicateJobError, Pipeline, ServerStoppedError
from prorl_server.routes import (APP_ROUTES, ApiError, Route, add_routes, auth_middleware, error_middleware,
                                 json_response, openapi_schema, parse_body)
from prorl_server.types import (AddBackendRequest, CancelRequest, CancelResponse,
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


# ------------------------------------------------------------------------------------------ middlewares


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
