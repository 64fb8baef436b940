"""prorl-build-image finds its Singularity templates in an installed project, not only in a checkout: the
wheel carries them (setup.cfg data_files) and ``find_templates_dir`` looks under the install prefix."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from sandbox.image_build import INSTALLED_TEMPLATES_SUBDIR, REPO_ROOT, find_templates_dir

TEMPLATES = sorted(os.listdir(REPO_ROOT / "singularity" / "templates"))


def test_checkout_templates_first_then_installed_prefix(tmp_path):
    assert find_templates_dir() == REPO_ROOT / "singularity" / "templates"
    installed = tmp_path / "prefix" / INSTALLED_TEMPLATES_SUBDIR
    installed.mkdir(parents=True)
    assert find_templates_dir(tmp_path / "site-packages", [str(tmp_path / "nothing"), str(tmp_path / "prefix")]) \
        == installed
    # Nothing anywhere: the checkout path, so that the error names where templates were expected.
    assert find_templates_dir(tmp_path / "x", [str(tmp_path / "nothing")]) == tmp_path / "x" / "singularity" / \
        "templates"


@pytest.mark.real
def test_installed_wheel_ships_the_templates_and_image_build_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # A clean copy of what a clone holds (no build/ or egg-info in the shared checkout).
    for name in ("setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (REPO_ROOT / name).exists():
            shutil.copy(REPO_ROOT / name, src / name)
    for name in ("prorl_server", "sandbox", "handlers", "trainer_plugins", "singularity"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True)
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = [n.split("/data/", 1)[1] for n in names if ".data/data/" in n]
    assert sorted(data) == sorted(f"{INSTALLED_TEMPLATES_SUBDIR.as_posix()}/{t}" for t in TEMPLATES
                                  if not t.endswith(".md") and t != "__pycache__"), data

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    # The installed project first; its dependencies (jinja2, ...) from this environment after it.
    installed_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    check=True, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": f"{installed_site}:{sysconfig.get_paths()['purelib']}"}
    env.pop("PRORL_TEMPLATES_DIR", None)
    out = subprocess.run([str(py), "-c", "from sandbox.image_build import DEFAULT_TEMPLATES_DIR as d, list_templates"
                          " as l; print(d); print(*l())"], check=True, capture_output=True, text=True, env=env,
                         cwd=str(tmp_path)).stdout.split("\n")
    assert out[0] == str(venv / INSTALLED_TEMPLATES_SUBDIR)
    assert out[1].split() == sorted(t[:-len(".def.j2")] for t in TEMPLATES
                                    if t.endswith(".def.j2") and not t.startswith("_"))
