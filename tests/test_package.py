"""The package's layout holds: short modules with an explicit ``__all__``, and no private name
(``_x``) imported across a module boundary, in ``accumjax/`` or ``benchmarks/``.

Shared internals live in ``_``-prefixed modules under public names (``accumjax._checks``);
what a benchmark needs is public. The map of modules is in ``docs/design.md``.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = sorted((ROOT / "accumjax").glob("*.py"))
CHECKED = PACKAGE + sorted((ROOT / "benchmarks").glob("*.py"))
# About 600 lines a module (issue 20): a module past this is doing more than one job.
MAX_LINES = 620


def _private_imports(path: Path) -> list[str]:
    """``module.name`` for each private name ``path`` takes from an accumjax module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accumjax"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and (isinstance(node.value, ast.Name) and node.value.id in ("accumjax", "window_lib"))
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_private_name_crosses_a_module_boundary(path):
    assert _private_imports(path) == []


def test_the_check_finds_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from accumjax.planner import _divisors\nimport accumjax\naccumjax._x\n")
    assert _private_imports(bad) == ["accumjax.planner._divisors", "accumjax._x"]


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: p.name)
def test_modules_are_short_and_declare_their_api(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    names = {
        t.id
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    assert "__all__" in names


def _design_map() -> list[tuple[str, set[str]]]:
    """``(module, modules it may import)`` rows of the map in ``docs/design.md``, in order."""
    rows = []
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith(".py`"):
            allowed = set() if cells[2] == "nothing" else set(cells[2].replace("`", "").split(", "))
            rows.append((cells[0].strip("`")[: -len(".py")], allowed))
    return rows


def _imports(path: Path) -> set[str]:
    """The accumjax modules ``path`` imports from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accumjax."):
            found.add(node.module.split(".")[1])  # pyright: ignore[reportOptionalMemberAccess]
        elif isinstance(node, ast.ImportFrom) and node.module == "accumjax":
            found |= {a.name for a in node.names}
    return found


def test_the_design_map_lists_every_module_once():
    listed = [name for name, _ in _design_map()]
    assert sorted(listed) == sorted(p.stem for p in PACKAGE if p.stem != "__init__")


@pytest.mark.parametrize("row", range(len(_design_map())))
def test_each_module_imports_only_what_the_design_map_allows_from_above(row):
    rows = _design_map()
    name, allowed = rows[row]
    above = {n for n, _ in rows[:row]}
    assert allowed <= above, f"{name} may import only modules above it in the map"
    assert _imports(ROOT / "accumjax" / f"{name}.py") <= allowed


def test_one_version_from_one_source():
    """``accumjax.__version__`` is the installed distribution's and the CHANGELOG's newest
    release: pyproject.toml reads it (``dynamic = ["version"]``), so they cannot drift."""
    import re
    from importlib.metadata import version

    import accumjax

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'path = "accumjax/__init__.py"' in pyproject
    assert version("accumjax") == accumjax.__version__
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == accumjax.__version__
