"""The documentation keeps up with the code: the module map, the README's length, and every relative link.

**The module map** is the table in docs/ARCHITECTURE.md whose rows each start with one package folder in
backticks (`peer/stage/`, `peer/stage/chain/`, `coordinator/`, `swarmpipe/cli/`). In a row, every backticked
name ending in ``.py`` is a module *relative to that row's folder*: `runtime.py` in the `peer/stage/` row is
peer/stage/runtime.py, `export/llama.py` in the `coordinator/` row is coordinator/export/llama.py. The rule:

* every ``.py`` file under peer/, coordinator/ and swarmpipe/ is named in the map, except an ``__init__.py`` that
  defines no function or class (a docstring, re-exports, ``__all__``, a version): that package is named by its
  folder, which must be a row's folder or the folder of a module the map names. An ``__init__.py`` with logic
  (peer/model/'s ``FAMILIES``, peer/optim/'s factory, coordinator/export/'s ``export_checkpoint``) is named like
  any module (`__init__.py`, or `export/__init__.py` from the `coordinator/` row);
* every module the map names exists;
* elsewhere in ARCHITECTURE.md and in the other guides, a backticked path that names a Python module (it ends in
  ``.py``, or is ``path/module.attribute`` such as `transport/wire.encode_parts`) exists, read from the repository
  root or, as the guides abbreviate, from peer/ or swarmpipe/.

protos/ holds generated code (`make protos`; tests/unit/test_protos_drift.py watches it), so it is not mapped.

**README.md** stays a five-minute read: at most 300 lines, no line over 300 characters.

**Links**: every relative link in README.md and docs/*.md points to a file that exists, and a ``#fragment`` to a
heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("peer", "coordinator", "swarmpipe")
README_MAX_LINES = 300
README_MAX_LINE_CHARS = 300

BACKTICKED = re.compile(r"`([^`\n]+)`")
FOLDER_CELL = re.compile(r"^`([A-Za-z0-9_./-]+/)`$")
# a relative path of plain segments (no spaces, braces or placeholders), at least one slash
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+$")
NOT_MODULE = re.compile(r"\.(md|toml|txt|json|jsonl|yml|yaml|sh|proto|png|parquet|safetensors|prom|tokens)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _defines_logic(init: Path) -> bool:
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def package_modules() -> tuple[set[str], set[str]]:
    """(modules the map must name, package folders the map must name), as paths from the repository root."""
    modules, folders = set(), set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" and not _defines_logic(path):
                folders.add(path.parent.relative_to(ROOT).as_posix() + "/")
            else:
                modules.add(rel)
    return modules, folders


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def module_map(text: str) -> tuple[dict[str, str], set[str]]:
    """The map's modules (path from the root -> the row's folder) and the rows' folders."""
    named: dict[str, str] = {}
    rows: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        match = FOLDER_CELL.match(cells[0]) if cells else None
        if not match or not (ROOT / match.group(1)).is_dir():
            continue
        folder = match.group(1)
        rows.add(folder)
        for cell in cells[1:]:
            for token in BACKTICKED.findall(cell):
                if token.endswith(".py") and PATH_TOKEN.match(folder + token):
                    named[folder + token] = folder
    return named, rows


def _resolves(token: str) -> bool:
    """A module path as the guides write it: from the root, or abbreviated from peer/ or swarmpipe/."""
    candidates = [token]
    if not token.endswith(".py"):
        head, _, attribute = token.rpartition(".")
        if not attribute.isidentifier() or "/" not in head:
            return True  # not a module.attribute path (a .md, .toml, .proto file is for the link check)
        candidates = [head + ".py", head + "/__init__.py"]
    return any((ROOT / base / c).is_file() for base in ("", "peer", "swarmpipe") for c in candidates)


def module_mentions(text: str) -> set[str]:
    """Backticked module paths a document names outside the map's rows."""
    found = set()
    for line in text.splitlines():
        if line.startswith("|") and FOLDER_CELL.match(_cells(line)[0] or ""):
            continue  # a map row: its names are relative to its folder, checked by module_map
        for token in BACKTICKED.findall(line):
            token = token.strip()
            if not PATH_TOKEN.match(token) or NOT_MODULE.search(token):
                continue
            last = token.rsplit("/", 1)[1]
            if "." in last and last.rsplit(".", 1)[1].isidentifier():
                found.add(token)  # path/module.py or path/module.attribute
    return found


def test_every_module_is_on_the_map():
    named, rows = module_map(ARCHITECTURE.read_text(encoding="utf-8"))
    modules, folders = package_modules()
    missing = sorted(modules - set(named))
    assert not missing, (
        "modules docs/ARCHITECTURE.md does not name (add each to its package's row of the module map, by its path"
        f" relative to the row's folder): {missing}"
    )
    covered = rows | {str(Path(path).parent.as_posix()) + "/" for path in named}
    unnamed = sorted(folder for folder in folders if not any(c == folder or c.startswith(folder) for c in covered))
    assert not unnamed, f"packages docs/ARCHITECTURE.md does not name (give each a row of the module map): {unnamed}"


def test_the_map_names_no_module_that_is_gone():
    named, _ = module_map(ARCHITECTURE.read_text(encoding="utf-8"))
    gone = sorted(f"{path} (row {folder})" for path, folder in named.items() if not (ROOT / path).is_file())
    assert not gone, f"docs/ARCHITECTURE.md's module map names modules that do not exist: {gone}"


@pytest.mark.parametrize(
    "doc",
    [
        "docs/ARCHITECTURE.md",
        "README.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md") if p.name != "ARCHITECTURE.md"),
    ],
)
def test_module_paths_in_the_docs_exist(doc):
    gone = sorted(t for t in module_mentions((ROOT / doc).read_text(encoding="utf-8")) if not _resolves(t))
    assert not gone, f"{doc} names modules that do not exist (from the root, peer/ or swarmpipe/): {gone}"


def test_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into a guide in docs/"
    )
    long = [n for n, line in enumerate(lines, 1) if len(line) > README_MAX_LINE_CHARS]
    assert not long, f"README.md lines over {README_MAX_LINE_CHARS} characters: {long}"


def github_anchor(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#{1,6} ", line):
            anchor = github_anchor(line.lstrip("#"))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Relative link targets outside code blocks (a link's text may wrap onto the next line)."""
    prose, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(line)
    return [target for target in LINK.findall("\n".join(prose)) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
)
def test_relative_links_point_to_files_and_headings_that_exist(doc):
    source = ROOT / doc
    broken = []
    for target in links(source):
        file_part, _, fragment = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT).as_posix()})")
    assert not broken, f"{doc} has broken links: {broken}"


def test_the_checks_see_what_they_check():
    """The map parser finds the map (an empty result would pass every check above), and the anchors are GitHub's."""
    named, rows = module_map(ARCHITECTURE.read_text(encoding="utf-8"))
    assert {"peer/stage/", "peer/trainer/", "coordinator/", "swarmpipe/cli/"} <= rows
    assert len(named) > 50
    assert github_anchor("GPU stages (`bench/gpu.py`)") == "gpu-stages-benchgpupy"
    assert github_anchor("Where a 1 MiB call's time goes") == "where-a-1-mib-calls-time-goes"
    assert github_anchor("Stopping, preemption, nothing left behind") == "stopping-preemption-nothing-left-behind"
    assert module_mentions("`transport/wire.encode_parts` `protos/swarm.proto` `stage/gone.py` `samples/s`") == {
        "transport/wire.encode_parts",
        "stage/gone.py",
    }
    assert _resolves("transport/wire.encode_parts") and not _resolves("stage/gone.py")
