"""What every HTTP surface of the server shares: the route table type, error answers and middlewares.

:mod:`prorl_server.app` (the rollout API) and :mod:`prorl_server.gateway` (the agent-facing LLM API) both
declare their endpoints as :class:`Route` lists here and register them with :func:`add_routes`; the auth
middleware and ``/openapi.json`` read each route's declaration, so neither surface imports the other.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Optional, Type

from aiohttp import web
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from prorl_server.types import MAX_BODY_ITEMS, ErrorDetail, ErrorResponse
from sandbox.bounded_json import MAX_DEPTH, JsonBoundError, JsonBounds, ascan

log = logging.getLogger("prorl_server.app")


class ApiError(Exception):
    """An error answered as ``{error: {type, message, field?}}`` with HTTP ``status``."""

    def __init__(self, status: int, type_: str, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.field = status, type_, message, field


def json_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=model.model_dump_json(), status=status, content_type="application/json")


def error_response(status: int, type_: str, message: str, field: Optional[str] = None) -> web.Response:
    return json_response(ErrorResponse(error=ErrorDetail(type=type_, message=message, field=field)), status)


#: Bounds of a rollout-API body (``sandbox.bounded_json``): its size is the app's ``client_max_size``
#: (``max_body_mb``; aiohttp answers 413 beyond it), its items :data:`~prorl_server.types.MAX_BODY_ITEMS`.
BODY_BOUNDS = JsonBounds(max_bytes=1 << 40, max_items=MAX_BODY_ITEMS)


def json_bound_error(e: JsonBoundError, what: str = "request body") -> ApiError:
    """The answer to JSON refused by its bounds: 413 ``body_too_large`` (bytes), else 400 ``invalid_json``
    (not JSON) or ``json_too_complex`` (items, nesting, a number's digits), the message naming the bound."""
    if e.reason == "too_large":
        return ApiError(413, "body_too_large", f"{what} {e}")
    return ApiError(400, "invalid_json" if e.reason == "invalid" else "json_too_complex", f"{what} {e}")


async def parse_body(request: web.Request, model: Type[BaseModel]) -> Any:
    """Validate the JSON body against ``model``; no body at all (0 bytes) reads as ``{}``, while a body of
    whitespace only is not JSON. The body is scanned within :data:`BODY_BOUNDS` first (yielding to the event
    loop per 64 KiB), so a dense or hostile one is refused before pydantic builds anything.
    Raises ApiError 400 (not JSON, too complex: :func:`json_bound_error`) or 422 (wrong shape)."""
    body = await request.read()
    if not body:
        body = b"{}"
    try:
        await ascan(body, BODY_BOUNDS)
    except JsonBoundError as e:
        raise json_bound_error(e) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            if "recursion limit" in err["msg"]:  # the same parser as sandbox.bounded_json: its depth bound
                raise ApiError(400, "json_too_complex", f"request body is nested more than {MAX_DEPTH} levels "
                               "deep") from None
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



#: The routes of an app by handler: ``ROUTES`` plus those added by extensions (the gateway's). The auth
#: middleware reads each route's ``auth`` here; ``/openapi.json`` lists them.
APP_ROUTES = web.AppKey("app_routes", dict)


def add_routes(app: web.Application, routes: Iterable[Route]) -> None:
    """Register ``routes`` on ``app``: served, authorized as their ``auth`` says, listed in ``/openapi.json``."""
    for r in routes:
        app.router.add_route(r.method, r.path, r.handler)
        app[APP_ROUTES][r.handler] = r


def openapi_schema(routes: Iterable[Route], data_sources: Optional[list[str]] = None) -> dict[str, Any]:
    """OpenAPI 3.1 document generated from ``routes`` and their pydantic models; ``data_sources``: the
    handler names and aliases this server serves (``instance.data_source`` is one of them)."""
    routes = list(routes)
    models = {m for r in routes for m in (r.request, r.response) if m is not None} | {ErrorResponse}
    requests = {r.request for r in routes if r.request is not None}
    # a response model's schema is what the server writes (computed fields such as Trajectory.segments
    # included); a request model's is what it accepts
    _, defs = models_json_schema([(m, "validation" if m in requests else "serialization")
                                  for m in sorted(models, key=lambda m: m.__name__)],
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
