"""Core wire and domain types of the rollout service: the one module every other part imports.

The pydantic models here are the single definition of the HTTP wire contract (``/openapi.json`` is generated
from them). The contract is compatible with ProRL Agent Server clients: ``POST /process`` takes
``{instance, sampling_params, job_id?}`` and returns a :class:`JobResult`.
"""
from __future__ import annotations

import enum
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

CriticalError = Literal["init", "run", "eval", "timeout", "cancelled"]
Stage = Literal["init", "run", "eval"]
STAGES: tuple[Stage, ...] = ("init", "run", "eval")


class JobState(str, enum.Enum):
    """Lifecycle of a job. ``queued_*`` = waiting for a worker of that stage; ``done`` = result available."""

    queued_init = "queued_init"
    init = "init"
    queued_run = "queued_run"
    run = "run"
    queued_eval = "queued_eval"
    eval = "eval"
    done = "done"


# ---------------------------------------------------------------------------------------------- requests


class ProcessRequest(BaseModel):
    """Body of ``POST /process`` and ``POST /jobs``.

    ``instance`` must carry ``data_source`` (the handler name or an alias). ``sampling_params`` is passed
    through to the LLM backend (vLLM completions parameters: temperature, top_p, max_tokens, ...).
    ``timeout_s`` bounds the counted time (init + run + eval, queue waits excluded), in seconds.
    ``group_id`` names the group (the n samples of one prompt): the server runs a group's jobs on one LLM
    backend when load allows, so the prompt's prefix cache is shared (see ``affinity_slack``).
    """

    model_config = ConfigDict(extra="forbid")

    instance: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    job_id: Optional[str] = Field(default=None, min_length=1, max_length=200)
    timeout_s: Optional[float] = Field(default=None, gt=0)
    group_id: Optional[str] = Field(default=None, min_length=1, max_length=200)

    @field_validator("instance")
    @classmethod
    def _has_data_source(cls, v: dict[str, Any]) -> dict[str, Any]:
        ds = v.get("data_source")
        if not isinstance(ds, str) or not ds:
            raise ValueError("instance.data_source must be a non-empty string naming a handler")
        return v


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(min_length=1)


class AddBackendRequest(BaseModel):
    """Body of ``POST /add_llm_server``: an OpenAI-compatible server's base URL (http or https)."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(min_length=1)
    weight_version: Optional[int] = None

    @field_validator("address")
    @classmethod
    def _http_url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("address must be an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/")


# ---------------------------------------------------------------------------------------------- results


class Trajectory(BaseModel):
    """One token-level segment of a rollout.

    ``prompt_ids``: list[int] of length P (the context before the first generated token).
    ``response_ids``: list[int] of length R (everything after the prompt: generated tokens and the
    observation tokens appended between turns). ``response_logprobs`` and ``loss_mask`` have length R;
    ``loss_mask[i]`` is 1 for tokens the model generated and 0 for everything else, and
    ``response_logprobs[i]`` is 0.0 where the mask is 0.
    """

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    num_turns: int = 0
    weight_versions: list[int] = Field(default_factory=list)
    finish_reason: Optional[str] = None
    split_reason: Optional[str] = None


class Timing(BaseModel):
    """Per-phase wall time of a job, in seconds. ``counted_s`` = init + run + eval (what the timeout
    charges); ``queue_s`` = time spent waiting for a worker (reported, not charged)."""

    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    queue_s: float = 0.0
    counted_s: float = 0.0
    timeout_triggered: bool = False


class JobResult(BaseModel):
    """What a job returns, successful or not. ``reward`` is always a float (0.0 on failure).

    ``failure_kind``: why the job failed when the model did not cause it (one of
    :data:`prorl_server.failures.FAILURE_KINDS`: ``sandbox``, ``llm_backend``, ``harness``,
    ``agent_missing``, ``timeout``, ``cancelled``, ``invalid_instance``, ``handler``, ``internal``); null
    for a normal outcome, including every model-caused one (a wrong answer, a bad tool call, its own command
    timing out). ``filter``: true whenever ``failure_kind`` is set (or the handler asked for it): the sample
    must not be trained on; a trainer regenerates it.
    """

    job_id: str
    instance_id: Optional[str] = None
    trajectory_id: str
    handler: str
    reward: float = 0.0
    resolved: bool = False
    critical_error: Optional[CriticalError] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    filter: bool = False
    failure_kind: Optional[str] = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    trajectories: list[Trajectory] = Field(default_factory=list)
    timing: Timing = Field(default_factory=Timing)
    backend: Optional[str] = None
    weight_version: Optional[int] = None
    extra: dict[str, Any] = Field(default_factory=dict)


class SubmitResponse(BaseModel):
    job_id: str


class JobStatusResponse(BaseModel):
    job_id: str
    state: JobState
    result: Optional[JobResult] = None


class CancelResponse(BaseModel):
    job_id: str
    cancelled: bool = Field(description="True if this call stopped the job; False if it had already ended.")
    state: JobState


class BackendInfo(BaseModel):
    address: str
    in_flight: int
    healthy: bool
    weight_version: Optional[int] = None


class StageStatus(BaseModel):
    queued: int
    active: int
    workers: int


class StatusResponse(BaseModel):
    accepting: bool
    stages: dict[str, StageStatus]
    jobs_in_flight: int
    backends: list[BackendInfo]
    handlers: list[str]


class OkResponse(BaseModel):
    ok: bool = True
    detail: Optional[str] = None


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer of the server has this body."""

    error: ErrorDetail
