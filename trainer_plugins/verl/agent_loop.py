"""verl agent loop that runs each dataset row as a job on a ProRL rollout server (verl 0.9.1).

Registered through the YAML named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (see
``config/agent_loop.yaml``), not verl's ``@register`` decorator: the decorator only fills a registry in the
process that imports the module, and verl's ``AgentLoopWorker`` runs in a Ray worker that never imports it;
the YAML is read by every worker and instantiated with ``hydra.utils.instantiate``.

Per row, :meth:`ProRLAgentLoop.run`:

1. builds the instance (:meth:`ProRLAgentLoop.build_instance`) from the row: ``extra_info.instance`` when the
   dataset carries a full rollout-server instance, else ``{data_source, messages: raw_prompt, answer:
   reward_model.ground_truth}``; the ``handler`` setting overrides ``data_source``;
2. submits it with ``POST /process`` and a job id of its own to one of the rollout servers (same node first,
   then round-robin; a URL list or ``servers.json``) and awaits the result;
3. cancels the job on the server (``POST /cancel``) if the loop is cancelled (verl aborts a rollout) or the
   request outlives ``request_timeout_s``; a timed-out row becomes a zero-reward row with no response tokens;
4. returns ``AgentLoopOutput``: the server's token-level trajectory (``prompt_ids``, ``response_ids``,
   ``response_mask`` = our ``loss_mask``, per-token ``response_logprobs``), ``reward_score`` = the job's
   reward, and ``extra_fields`` with ``reward_extra_info = {"acc": resolved, "score": reward}`` (DAPO's
   ``algorithm.filter_groups.metric``) and integer ``min_global_steps`` / ``max_global_steps`` (the weight
   versions the trajectory was generated with; the V1 trainer's staleness tags need both), the prompt
   left-truncated to ``rollout.prompt_length`` and the response cut to ``rollout.response_length``.

The reward is the rollout server's (its handler's eval stage), so verl's reward loop is not needed for these
rows; verl only computes one for rows whose ``reward_score`` is None.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any, Optional, Sequence, Union

import aiohttp
import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from trainer_plugins.client import resolve_servers

log = logging.getLogger(__name__)

Servers = Union[str, Sequence[str], None]


def _jsonable(x: Any) -> Any:
    """numpy scalars/arrays (verl's non-tensor batch) and OmegaConf containers -> plain JSON types."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, dict) or hasattr(x, "items"):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or (hasattr(x, "__iter__") and not isinstance(x, (str, bytes))):
        return [_jsonable(v) for v in x]
    return x


class ProRLAgentLoop(AgentLoopBase):
    """``AgentLoopBase`` whose rollouts run on ProRL rollout servers.

    Keyword settings (from the YAML entry; the other arguments are verl's, passed by ``AgentLoopWorker``):
        servers: rollout servers: a comma-separated URL list, a list of URLs, or the path of ``servers.json``
            (file or directory; token and same-node ordering come from it). Required.
        token: bearer token (servers.json brings its own).
        handler: force ``instance.data_source`` (when the dataset's data_source is not a handler name).
        job_timeout_s: the job's ``timeout_s`` (counted seconds on the server; None: the server default).
        request_timeout_s: wall-clock limit of one row, queue waits included (None: none); the job is
            cancelled on the server when it passes.
        max_tokens: per-turn ``max_tokens`` sent to the server (default: ``rollout.response_length``).
    """

    _rr = itertools.count()  # round-robin over the servers, shared by every loop of this process
    _resolved: dict[str, tuple[list[str], dict[str, str]]] = {}  # servers setting -> (urls, headers)

    def __init__(self, *args: Any, servers: Servers = None, token: Optional[str] = None,
                 handler: Optional[str] = None, job_timeout_s: Optional[float] = None,
                 request_timeout_s: Optional[float] = None, max_tokens: Optional[int] = None,
                 **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the registry entry's own name
        kwargs.pop("tools", None)  # tools run in the rollout server's sandboxes, not here
        super().__init__(*args, **kwargs)
        if not servers:
            raise ValueError("ProRLAgentLoop needs `servers` (URLs or servers.json) in its agent loop YAML entry")
        self.servers = servers if isinstance(servers, str) else ",".join(servers)
        self.token = token
        self.handler = handler
        self.job_timeout_s = job_timeout_s
        self.request_timeout_s = request_timeout_s
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.max_tokens = max_tokens or self.response_length

    # ------------------------------------------------------------------ servers
    async def _servers(self) -> tuple[list[str], dict[str, str]]:
        cached = self._resolved.get(self.servers)
        if cached is None:
            urls, headers, _ = await asyncio.to_thread(resolve_servers, self.servers)  # may read servers.json
            cached = self._resolved[self.servers] = (urls, headers)
        urls, headers = cached
        if self.token:
            headers = {**headers, "Authorization": f"Bearer {self.token}"}
        return urls, headers

    # ------------------------------------------------------------------ row -> instance
    def build_instance(self, row: dict[str, Any]) -> dict[str, Any]:
        """The rollout-server instance for one dataset row (verl's non-tensor fields, see the module doc)."""
        extra = _jsonable(row.get("extra_info") or {})
        instance = dict(extra.get("instance") or {})
        if self.handler:
            instance["data_source"] = self.handler
        instance.setdefault("data_source", _jsonable(row.get("data_source")))
        if "messages" not in instance and row.get("raw_prompt") is not None:
            instance["messages"] = _jsonable(row["raw_prompt"])
        ground_truth = _jsonable(row.get("reward_model") or {}).get("ground_truth")
        if ground_truth is not None:
            instance.setdefault("answer", ground_truth)
        if "index" in extra:
            instance.setdefault("instance_id", str(extra["index"]))
        return instance

    def sampling_params_for_server(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """verl's sampling params -> vLLM completions parameters (the server always asks for logprobs)."""
        sp = {k: _jsonable(v) for k, v in sampling_params.items() if k in ("temperature", "top_p", "top_k",
                                                                        "repetition_penalty", "seed")}
        if sp.get("top_k") in (-1, 0, None):
            sp.pop("top_k", None)
        sp["max_tokens"] = self.max_tokens
        return sp

    # ------------------------------------------------------------------ run
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Run one row as a job on a rollout server; see the module docstring.

        Raises:
            asyncio.CancelledError: the loop was cancelled (the job is cancelled on the server first).
            RuntimeError: the server refused the job (4xx/5xx: bad instance, unknown handler, no backend).
        """
        urls, headers = await self._servers()
        url = urls[next(self._rr) % len(urls)]
        job_id = f"verl-{uuid.uuid4().hex}"
        body: dict[str, Any] = {"instance": self.build_instance(kwargs), "job_id": job_id,
                                "sampling_params": self.sampling_params_for_server(sampling_params)}
        if self.job_timeout_s is not None:
            body["timeout_s"] = float(self.job_timeout_s)
        try:
            result = await asyncio.wait_for(self._process(url, headers, body), self.request_timeout_s)
        except asyncio.CancelledError:
            await asyncio.shield(self._cancel(url, headers, job_id))
            raise
        except TimeoutError:
            await asyncio.shield(self._cancel(url, headers, job_id))
            log.warning("job %s on %s passed request_timeout_s=%s; cancelled", job_id, url, self.request_timeout_s)
            result = {"job_id": job_id, "reward": 0.0, "resolved": False, "critical_error": "timeout",
                      "error": f"no result within {self.request_timeout_s} s", "trajectories": []}
        return await self.to_output(result, kwargs)

    async def _process(self, url: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as s:
            async with s.post(f"{url}/process", json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"rollout server {url} refused job {body['job_id']}: HTTP {r.status} {data}")
                return data

    async def _cancel(self, url: str, headers: dict[str, str], job_id: str) -> None:
        # /process may not have registered the job yet (404): retry briefly.
        try:
            async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as s:
                for _ in range(20):
                    async with s.post(f"{url}/cancel", json={"job_id": job_id}) as r:
                        if r.status != 404:
                            return
                    await asyncio.sleep(0.05)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not cancel job %s on %s: %s", job_id, url, e)

    # ------------------------------------------------------------------ result -> AgentLoopOutput
    async def to_output(self, result: dict[str, Any], row: dict[str, Any]) -> AgentLoopOutput:
        """Job result -> ``AgentLoopOutput`` (first trajectory segment; lengths capped to the rollout
        config). A job with no trajectory (failed, timed out) yields the row's prompt, an empty response and
        its (zero) reward, so the batch keeps its shape and the row carries no loss."""
        trajectories = result.get("trajectories") or []
        traj = trajectories[0] if trajectories else None
        if traj is not None and traj.get("prompt_ids"):
            prompt_ids = list(traj["prompt_ids"])
            response_ids = list(traj.get("response_ids") or [])
            response_mask = [int(m) for m in traj.get("loss_mask") or []]
            logprobs = [float(x) for x in traj.get("response_logprobs") or []]
        else:
            messages = self.build_instance(row).get("messages") or []
            prompt_ids = await self.ct_build_initial_tokens(messages) if messages else []
            response_ids, response_mask, logprobs = [], [], []
        if len(response_mask) != len(response_ids):
            raise ValueError(f"job {result.get('job_id')}: loss_mask has {len(response_mask)} entries for "
                             f"{len(response_ids)} response tokens")
        if logprobs and len(logprobs) != len(response_ids):
            raise ValueError(f"job {result.get('job_id')}: {len(logprobs)} logprobs for {len(response_ids)} tokens")
        prompt_ids = prompt_ids[-self.prompt_length:]
        cut = self.response_length

        versions = [v for t in trajectories for v in t.get("weight_versions") or () if isinstance(v, int)]
        if isinstance(result.get("weight_version"), int):
            versions.append(result["weight_version"])
        if not versions:  # the server knows no version: the trainer step that asked for the row
            gs = row.get("global_steps")
            versions = [int(_jsonable(gs)) if gs is not None else 0]
        reward = float(result.get("reward") or 0.0)
        timing = result.get("timing") or {}
        extra_fields = {
            "reward_extra_info": {"acc": 1.0 if result.get("resolved") else 0.0, "score": reward},
            "min_global_steps": int(min(versions)),
            "max_global_steps": int(max(versions)),
            "turn_scores": [],
            "tool_rewards": [],
            "prorl": {"job_id": result.get("job_id"), "backend": result.get("backend"),
                      "critical_error": result.get("critical_error"), "segments": len(trajectories),
                      "finish_reason": traj.get("finish_reason") if traj else None,
                      "truncated": len(response_ids) > cut, "timing": timing},
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:cut],
            response_mask=response_mask[:cut],
            response_logprobs=logprobs[:cut] if logprobs else None,
            reward_score=reward,
            num_turns=len(result.get("messages") or []) or 2,
            metrics=AgentLoopMetrics(generate_sequences=float(timing.get("run_s") or 0.0),
                                     compute_score=float(timing.get("eval_s") or 0.0)),
            extra_fields=extra_fields,
        )
