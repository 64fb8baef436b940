"""Singularity/Apptainer runtime: binary choice and the exact command line (unit tests; no binary needed),
plus an integration test that runs only where apptainer or singularity is installed."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from sandbox import SandboxSpec
from sandbox.errors import SandboxError, SandboxStartError
from sandbox.runtime import SERVER_ENTRY, LaunchContext
from sandbox.singularity import build_singularity_command, find_singularity

FAKE_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_apptainer_exec.py")

CTX = LaunchContext(sandbox_id="sb-1", run_dir="/state/run/sb-1", workspace="/scratch/ws1",
                    sandbox_run_dir="/run/prorl", sandbox_workspace="/workspace", python="/venv/bin/python",
                    pythonpath=["/proj", "/venv/lib/python3.11/site-packages"], address=None)
SERVER = ["/venv/bin/python", "-S", "-c", SERVER_ENTRY, "--socket", "/run/prorl/exec.sock",
          "--config", "/run/prorl/config.json"]


def test_default_command_line_is_exact():
    argv = build_singularity_command("/usr/bin/apptainer", SandboxSpec(image="/img/task.sif"), CTX,
                                     ro_paths=["/proj", "/venv"])
    assert argv == [
        "/usr/bin/apptainer", "exec", "--containall", "--no-home", "--no-mount", "hostfs,bind-paths,cwd",
        "--cleanenv", "--pwd", "/workspace",
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
        "singularity", "exec", "--containall", "--no-home", "--no-mount", "hostfs,bind-paths,cwd",
        "--cleanenv", "--pwd", "/testbed",
        "--fakeroot", "--writable-tmpfs",
        "--bind", "/data:/data:ro", "--bind", "/out:/mnt/out:rw",
        "--bind", "/state/run/sb-1:/run/prorl:rw", "--bind", "/scratch/ws1:/workspace:rw",
        "--env", "PYTHONPATH=/proj:/venv/lib/python3.11/site-packages",
        "/img/task.sif", *SERVER]


def test_image_with_its_own_venv_runs_the_server_with_it_and_binds_nothing_of_the_host_interpreter():
    argv = build_singularity_command("apptainer", SandboxSpec(image="/img/task.sif"), CTX, ro_paths=["/proj"],
                                     exec_python="/opt/prorl/venv/bin/python")
    assert argv == [
        "apptainer", "exec", "--containall", "--no-home", "--no-mount", "hostfs,bind-paths,cwd",
        "--cleanenv", "--pwd", "/workspace", "--net", "--network", "none",
        "--bind", "/state/run/sb-1:/run/prorl:rw", "--bind", "/scratch/ws1:/workspace:rw",
        "/img/task.sif", "/opt/prorl/venv/bin/python", "-I", "-m", "sandbox.exec_server",
        "--socket", "/run/prorl/exec.sock", "--config", "/run/prorl/config.json"]


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


@pytest.fixture
def fake_apptainer(tmp_path, monkeypatch):
    """``apptainer`` on PATH = tests/sandbox/fake_apptainer_exec.py (see its docstring); returns the log path."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    path = bindir / "apptainer"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_EXEC} \"$@\"\n")
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    log = tmp_path / "apptainer.log"
    monkeypatch.setenv("FAKE_APPTAINER_LOG", str(log))
    monkeypatch.delenv("FAKE_APPTAINER_REFUSE", raising=False)
    monkeypatch.delenv("FAKE_IMAGE_EXEC_PYTHON", raising=False)
    return log


def _calls(log) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_site_without_network_namespaces_fails_at_start_naming_the_flag(fake_apptainer, runtime_options,
                                                                             monkeypatch):
    from sandbox import make_runtime

    monkeypatch.setenv("FAKE_APPTAINER_REFUSE", "--net")
    rt = make_runtime("apptainer", **runtime_options)
    with pytest.raises(SandboxStartError, match=r"(?s)refuses the isolation flag `--net --network none`.*network "
                                                r"namespaces are disabled"):
        await rt.start(SandboxSpec(image="/img/task.sif"))
    probe = _calls(fake_apptainer)[0]
    # The probe carries exactly the isolation flags of the real launch.
    assert probe[:11] == ["exec", "--containall", "--no-home", "--no-mount", "hostfs,bind-paths,cwd",
                          "--cleanenv", "--net", "--network", "none", "/img/task.sif", "/bin/sh"]
    assert not any(c[0] == "exec" and "sandbox.exec_server" in c for c in _calls(fake_apptainer))
    run = os.path.join(runtime_options["state_dir"], "run")
    assert rt.handles == [] and (not os.path.exists(run) or os.listdir(run) == [])
    # network="host" needs no network namespace: that spec passes the probe.
    assert await rt.probe(SandboxSpec(image="/img/task.sif", network="host")) == ""


async def test_refused_fakeroot_is_named_and_unexplained_failures_show_the_output(fake_apptainer, runtime_options,
                                                                                 monkeypatch):
    from sandbox import make_runtime

    monkeypatch.setenv("FAKE_APPTAINER_REFUSE", "--fakeroot")
    rt = make_runtime("apptainer", **runtime_options)
    with pytest.raises(SandboxStartError, match="(?s)`--fakeroot`.*fakeroot=False"):
        await rt.probe(SandboxSpec(image="/img/task.sif", fakeroot=True))
    monkeypatch.setenv("FAKE_APPTAINER_REFUSE", "--containall")
    with pytest.raises(SandboxStartError, match="(?s)cannot run image /img/task.sif.*feature disabled"):
        await rt.probe(SandboxSpec(image="/img/task.sif"))


async def test_probe_runs_once_per_image_and_finds_the_image_venv(fake_apptainer, runtime_options, monkeypatch):
    from sandbox import make_runtime

    monkeypatch.setenv("FAKE_IMAGE_EXEC_PYTHON", sys.executable)  # stands for /opt/prorl/venv/bin/python
    rt = make_runtime("apptainer", **runtime_options)
    spec = SandboxSpec(image="/img/built.sif")
    assert await rt.probe(spec) == sys.executable
    await rt.prepare_launch(spec)
    await rt.prepare_launch(spec)
    assert len(_calls(fake_apptainer)) == 1
    ctx = LaunchContext(sandbox_id="sb-2", run_dir="/s/run/sb-2", workspace="/w", sandbox_run_dir="/run/prorl",
                        sandbox_workspace="/workspace", python="/host/python", pythonpath=["/proj"], address=None)
    argv = rt.build_command(spec, ctx)
    assert argv[argv.index("/img/built.sif") + 1:][:4] == [sys.executable, "-I", "-m", "sandbox.exec_server"]
    assert "--env" not in argv and not any(a.startswith("/proj") for a in argv)
    monkeypatch.setenv("FAKE_IMAGE_EXEC_PYTHON", "/no/such/python")  # a venv that is not there: host python
    other = SandboxSpec(image="/img/plain.sif")
    await rt.prepare_launch(other)
    argv = rt.build_command(other, ctx)
    assert argv[-8:-6] == ["/host/python", "-S"] and "PYTHONPATH=/proj" in argv


@pytest.mark.real  # a Python subprocess
def test_the_image_venv_server_command_ignores_modules_in_the_working_directory(tmp_path):
    # The image's runscript and argv run `python -I -m sandbox.exec_server` with --pwd the workspace: a task
    # repository with its own `sandbox/` package there must not replace the server (before, `-m` imported it).
    import subprocess

    (tmp_path / "sandbox").mkdir()
    (tmp_path / "sandbox" / "__init__.py").write_text("raise SystemExit('the workspace shadowed the server')\n")
    argv = build_singularity_command("apptainer", SandboxSpec(image="/img/task.sif"), CTX, ro_paths=["/proj"],
                                     exec_python=sys.executable)
    tail = argv[argv.index("/img/task.sif") + 1:argv.index("sandbox.exec_server") + 1]
    r = subprocess.run(tail, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "shadowed" not in r.stderr and "usage: python -m sandbox.exec_server" in r.stderr, r.stderr
