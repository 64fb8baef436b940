"""The docs can be found and their links lead somewhere (issue #27 item 4).

Every relative link in ``README.md``, ``docs/*.md`` and the other Markdown files of the tree (the folders'
READMEs) points to a file or folder that exists, and every ``#anchor`` to a heading of the file it names, by
GitHub's rules for heading ids. The top-level README stays a first page (under 200 lines) that keeps the two
set-up commands the CI and the graders run verbatim, and links the docs index, which links every page.
"""
from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The two set-up commands, byte for byte as the CI (``.ci/run``) and the graders run them.
SETUP_COMMANDS = (
    "```bash\nbash .ci/install && .venv/bin/prorl-run --dataset humaneval --limit 8 --samples 2\n```\n",
    '```bash\nbash .ci/install && .venv/bin/python -m pytest -m "not real" && .venv/bin/python -m pytest -m real\n```\n',
)

_SKIP_DIRS = {"node_modules", "build", "dist", "out", "__pycache__"}
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path) -> list[Path]:
    """The tree's Markdown files, without hidden folders (``.venv``, ``.git``, ``.cache``) and build outputs."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS
                         and not d.endswith(".egg-info"))
        found += [Path(folder) / f for f in sorted(files) if f.endswith(".md")]
    return found


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks, code spans blanked (a link or a heading
    written inside code is not one)."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((n, _CODE_SPAN.sub(lambda c: "code", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's id of a heading: its text (formatting removed), lower-cased, without punctuation but ``-`` and
    ``_``, spaces turned into ``-``."""
    text = _INLINE_LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"`+", "", text).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of a Markdown file's headings; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    ids = set()
    fence = None
    for line in text.split("\n"):  # headings are read from the raw line: a code span in one is still its text
        m = _FENCE.match(line)
        if m:
            fence = m.group(1) if fence is None else (None if m.group(1) == fence else fence)
            continue
        h = _HEADING.match(line) if fence is None else None
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    ids |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return ids


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link, image and reference definition in prose."""
    out = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        out += [(n, m.group(2)) for m in _INLINE_LINK.finditer(line)]
        ref = _REF_DEF.match(line)
        if ref:
            out.append((n, ref.group(1)))
    return out


def broken_links(root: Path, files: list[Path]) -> list[str]:
    """Each relative link of ``files`` that names no existing file or folder under ``root``, or a heading its
    file does not have: ``"<file>:<line>: <target>: <why>"``."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for src in files:
        for n, target in links(src):
            if not target or _SCHEME.match(target) or target.startswith("//"):
                continue  # an external address (http:, mailto:, ...)
            where = f"{src.relative_to(root)}:{n}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (src.parent / file_part).resolve() if file_part else src.resolve()
            if not dest.is_relative_to(root.resolve()):
                problems.append(f"{where}: leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root.resolve())}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    files = markdown_files(ROOT)
    names = {str(p.relative_to(ROOT)) for p in files}
    assert {"README.md", "docs/README.md", "docs/training-verl.md", "handlers/code/README.md"} <= names
    n_links = sum(len(links(p)) for p in files)
    assert n_links > 50, f"only {n_links} links found: is the link pattern still right?"
    problems = broken_links(ROOT, files)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_reports_a_missing_file_a_missing_heading_and_an_escape(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Scale: 4,096 jobs, `--processes`\n\n## Twice\n"
                                               "## Twice\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok](docs/page.md#scale-4096-jobs---processes) [ok](docs/page.md#twice-1)"
        " [ok](docs/) [ok](https://example.org/x.md) [ok](#top) `[code](missing.md)`\n\n# Top\n\n"
        "[gone](docs/gone.md)\n[bad anchor](docs/page.md#not-a-heading)\n[out](../elsewhere.md)\n"
        "[ref]: docs/missing-too.md\n")
    assert broken_links(tmp_path, markdown_files(tmp_path)) == [
        "README.md:5: docs/gone.md: no such file",
        "README.md:6: docs/page.md#not-a-heading: no heading #not-a-heading in docs/page.md",
        "README.md:7: ../elsewhere.md: leaves the repository",
        "README.md:8: docs/missing-too.md: no such file",
    ]


def test_the_readme_is_a_first_page_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    for command in SETUP_COMMANDS:
        assert command in text, f"the set-up command is no longer in the README verbatim:\n{command}"
    assert "(docs/README.md)" in text, "the README links the docs index"


def test_the_docs_index_links_every_page():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    assert pages and pages - linked == set(), f"pages the index does not list: {sorted(pages - linked)}"


# ------------------------------------------------------------------------------------------ the module map
#: The packages whose every module the Layout table of docs/architecture.md names.
MAPPED_PACKAGES = ("sandbox", "singularity", "prorl_server", "handlers", "trainer_plugins")


def layout_rows(text: str) -> list[tuple[set[str], str]]:
    """``(paths in the first cell, the second cell)`` of each row of the page's "Layout" table."""
    section = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-: "):
            paths = {p.strip("*") for p in re.findall(r"`([^`]+)`", cells[0])}
            rows.append((paths, cells[1]))
    return rows


def unmapped_modules(root: Path, rows: list[tuple[set[str], str]]) -> list[str]:
    """Modules the Layout table does not name: a module counts as named by a row of its own path, or, inside a
    folder that has a row of its own (``handlers/code/``), by that row naming its file (``grading.py``); a
    package's ``__init__.py`` by a row of its folder."""
    own = set().union(*(paths for paths, _ in rows)) if rows else set()
    folder_text = {p: text for paths, text in rows for p in paths if p.endswith("/")}
    missing = []
    for pkg in MAPPED_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            folder = path.parent.relative_to(root).as_posix() + "/"
            if any(rel in p.replace(" ", "").split(",") or rel == p for p in own):
                continue
            if path.name == "__init__.py" and folder in folder_text:
                continue
            if folder in folder_text and f"`{path.name}`" in folder_text[folder]:
                continue
            missing.append(rel)
    return missing


def test_the_layout_table_names_every_module_of_the_packages():
    rows = layout_rows((ROOT / "docs" / "architecture.md").read_text())
    assert len(rows) > 60, "the Layout table was not found"
    missing = unmapped_modules(ROOT, rows)
    assert not missing, ("modules the Layout table of docs/architecture.md does not name (add a row, or the file "
                         "name to its folder's row):\n" + "\n".join(missing))
    named = {p for paths, _ in rows for p in paths if "/" in p and not p.startswith(".")}
    gone = sorted(p for p in named if p.split("/")[0] in MAPPED_PACKAGES + ("slurm", "benchmarks", "tests")
                  and not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"the Layout table names paths that do not exist: {gone}"


def test_the_module_map_check_finds_an_unnamed_module(tmp_path):
    for rel in ("sandbox/a.py", "sandbox/__init__.py", "handlers/code/__init__.py", "handlers/code/grading.py",
                "handlers/code/data.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    rows = layout_rows("## Layout\n\n| module | holds |\n|---|---|\n| **`sandbox/`** | x |\n"
                       "| `sandbox/a.py` | a |\n| `handlers/code/` | `grading.py` |\n\n## Next\n")
    assert unmapped_modules(tmp_path, rows) == ["handlers/code/data.py"]
