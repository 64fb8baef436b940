"""Singularity/Apptainer runtime: binary choice and the exact command line (unit tests; no binary needed),
plus an integration test that runs only where apptainer or singularity is installed."""
from __future__ import annotations

import os
import stat

import pytest

from sandbox import SandboxSpec
from sandbox.errors import SandboxError
from sandbox.runtime import LaunchContext
from sandbox.singularity import build_singularity_command, find_singularity

CTX = LaunchContext(sandbox_id="sb-1", run_dir="/state/run/sb-1", workspace="/scratch/ws1",
                    sandbox_run_dir="/run/prorl", sandbox_workspace="/workspace", python="/venv/bin/python",
                    pythonpath=["/proj", "/venv/lib/python3.11/site-packages"], address=None)
SERVER = ["/venv/bin/python", "-S", "-m", "sandbox.exec_server", "--socket", "/run/prorl/exec.sock",
          "--config", "/run/prorl/config.json"]


def test_default_command_line_is_exact():
    argv = build_singularity_command("/usr/bin/apptainer", SandboxSpec(image="/img/task.sif"), CTX,
                                     ro_paths=["/proj", "/venv"])
    assert argv == [
        "/usr/bin/apptainer", "exec", "--containall", "--no-home", "--cleanenv", "--pwd", "/workspace",
        "--net", "--network", "none",
        "--bind", "/proj:/proj:ro", "--bind", "/venv:/venv:ro",
        "--bind", "/state/run/sb-1:/run/prorl:rw", "--bind", "/scratch/ws1:/workspace:rw",
        "--env", "PYTHONPATH=/proj:/venv/lib/python3.11/site-packages",
        "/img/task.sif", *SERVER]


def test_all_options_command_line_is_exact():
    spec = SandboxSpec(image="/img/task.sif", fakeroot=True, writable_tmpfs=True, network="host",
                       workdir="/testbed", binds=[("/data", "/data", True), ("/out", "/mnt/out", False)])
    argv = build_singularity_command("singularity", spec, CTX, ro_paths=[])
    assert argv == [
        "singularity", "exec", "--containall", "--no-home", "--cleanenv", "--pwd", "/testbed",
        "--fakeroot", "--writable-tmpfs",
        "--bind", "/data:/data:ro", "--bind", "/out:/mnt/out:rw",
        "--bind", "/state/run/sb-1:/run/prorl:rw", "--bind", "/scratch/ws1:/workspace:rw",
        "--env", "PYTHONPATH=/proj:/venv/lib/python3.11/site-packages",
        "/img/task.sif", *SERVER]


def test_missing_image_is_refused():
    with pytest.raises(SandboxError, match="needs spec.image"):
        build_singularity_command("apptainer", SandboxSpec(), CTX, ro_paths=[])


def _fake_binary(directory, name):
    # Stands for an installed apptainer/singularity: only its presence on PATH matters here.
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexit 1\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_apptainer_is_preferred_and_singularity_is_found_alone(tmp_path, monkeypatch):
    both, only = tmp_path / "both", tmp_path / "only"
    both.mkdir()
    only.mkdir()
    apptainer = _fake_binary(str(both), "apptainer")
    _fake_binary(str(both), "singularity")
    singularity = _fake_binary(str(only), "singularity")
    monkeypatch.setenv("PATH", str(both))
    assert find_singularity() == apptainer
    monkeypatch.setenv("PATH", str(only))
    assert find_singularity() == singularity
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_singularity() is None
    from sandbox import make_runtime

    with pytest.raises(SandboxError, match="neither `apptainer` nor `singularity`"):
        make_runtime("apptainer", state_dir=str(tmp_path / "state"))


@pytest.mark.real
@pytest.mark.skipif(find_singularity() is None, reason="neither apptainer nor singularity is installed here")
async def test_singularity_sandbox_runs_bash(runtime_options):
    from sandbox import make_runtime

    image = os.environ.get("PRORL_TEST_SIF")
    if not image:
        pytest.skip("set PRORL_TEST_SIF to a .sif image to run the Singularity integration test")
    rt = make_runtime("singularity", **runtime_options)
    h = await rt.start(SandboxSpec(image=image))
    try:
        assert (await h.bash("echo hi; pwd")).output == "hi\n/workspace\n"
    finally:
        await h.close()
