"""The package's layout holds: short modules with an explicit ``__all__``, and no private name
(``_x``) imported across a module boundary, in ``accumjax/`` or ``benchmarks/``.

Shared internals live in ``_``-prefixed modules under public names (``accumjax._checks``);
what a benchmark needs is public. The map of modules is in ``docs/design.md``.
"""

import ast
import importlib
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
        elif isinstance(node, ast.Import):  # import accumjax._window as window_lib
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("accumjax.")}
    return found


def test_the_design_map_lists_every_module_once():
    listed = [name for name, _ in _design_map()]
    assert sorted(listed) == sorted(p.stem for p in PACKAGE if p.stem != "__init__")


@pytest.mark.parametrize("row", range(len(_design_map())))
def test_each_module_imports_what_the_design_map_says_from_above(row):
    rows = _design_map()
    name, allowed = rows[row]
    above = {n for n, _ in rows[:row]}
    assert allowed <= above, f"{name} may import only modules above it in the map"
    assert _imports(ROOT / "accumjax" / f"{name}.py") == allowed


#: The modules a train step runs through (BatchNorm's own records are BatchNorm's).
STEP_PATH = [
    "_config",
    "_decision",
    "_host",
    "_layout",
    "_loop",
    "_loss_adapter",
    "_mesh",
    "_mesh_stream",
    "_multisteps",
    "_opt_state",
    "_reduction",
    "_scan",
    "_sharded_steps",
    "_split",
    "_state",
    "_step_checks",
    "_window",
    "_window_end",
    "_zero",
    "train_step",
]
#: Records the user holds (a checkpoint's structure): not the step's own.
USER_HELD = {"AccumulationState", "Window", "DeviceWindow"}


def _named_tuples(module: str) -> set[str]:
    """``module.Name`` for each NamedTuple class ``accumjax/<module>.py`` defines."""
    tree = ast.parse((ROOT / "accumjax" / f"{module}.py").read_text())
    return {
        f"{module}.{node.name}"
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, ast.Name) and b.id == "NamedTuple" for b in node.bases)
        and node.name not in USER_HELD
    }


def _design_records() -> set[str]:
    """The records the table of the step path's records in ``docs/design.md`` names."""
    found = set()
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and "." in cells[0]:
            found.add(cells[0].strip("`"))
    return found


def test_the_step_path_records_are_the_design_notes_table():
    records = set().union(*(_named_tuples(m) for m in STEP_PATH))
    assert records == _design_records()
    assert len(records) <= 10


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


# The window core: the modules the optax transformation runs. They import no feature module
# (clipping, BatchNorm, NNX, the train step, the planner, checkpoints) and no flax.
CORE = (
    "window",
    "_window",
    "_reduction",
    "_config",
    "_decision",
    "_control",
    "_norms",
    "_state",
    "_window_end",
    "scaling",
    "_scaling",
    "accumulation",
    "accumulation_state",
)
# What the core may import besides itself: validators, optax's names, NNX values read lazily,
# the forwarding of names 0.4 exported, the layout plan's table (`stats` sizes a window by it).
CORE_HELPERS = ("_checks", "_layout", "_moved", "_multisteps", "_variables")


def _third_party_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports at module level (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("name", CORE + CORE_HELPERS)
def test_the_window_core_imports_no_feature_module_and_no_flax(name):
    path = ROOT / "accumjax" / f"{name}.py"
    if not path.exists():
        pytest.skip(f"no {name}.py")
    assert _imports(path) <= set(CORE + CORE_HELPERS), name
    assert "flax" not in _third_party_imports(path)


def test_the_optax_transformation_imports_no_flax():
    import subprocess
    import sys

    code = "import accumjax.accumulation, sys; assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_flax_names_load_lazily_and_are_listed():
    import accumjax
    from accumjax import AccumBatchNorm, NNXAccumBatchNorm  # noqa: F401

    assert set(accumjax.__all__) <= set(dir(accumjax))
    assert all(hasattr(accumjax, name) for name in accumjax.__all__)
    with pytest.raises(AttributeError):
        accumjax.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("count_collectives", "accumjax.collectives"),
        ("data_sharding", "accumjax.distributed"),
        ("compiled_memory_bytes", "accumjax.planner"),
        ("scan_step_for_k", "accumjax.planner"),
    ],
)
def test_moved_names_warn_at_the_top_level_naming_their_module(name, where):
    import importlib

    import accumjax

    with pytest.warns(DeprecationWarning, match=rf"{where}\.{name}.*|.*0\.6.*{where}\.{name}"):
        value = getattr(accumjax, name)
    assert value is getattr(importlib.import_module(where), name)
    assert name not in accumjax.__all__


# Public names of public modules that are not top-level names: the state types, the
# strategy names, BatchNorm's variable names, the collectives counted, and the names moved
# out of the top level in 0.5.
SUBMODULE_ONLY = {
    "ACCUMULATOR_NAMES",
    "COLLECTIVE_OPS",
    "DeviceWindow",
    "MeshLayout",
    "SCALINGS",
    "Scaling",
    "Window",
    "compiled_memory_bytes",
    "count_collectives",
    "data_sharding",
    "scan_step_for_k",
}


@pytest.mark.parametrize(
    "path", [p for p in PACKAGE if not p.stem.startswith("_")], ids=lambda p: p.name
)
def test_public_modules_export_only_public_names(path):
    import importlib

    import accumjax

    exported = set(importlib.import_module(f"accumjax.{path.stem}").__all__)
    assert exported <= set(accumjax.__all__) | SUBMODULE_ONLY


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("window", "add_microbatch"),
        ("accumulation", "init_state"),
        ("scaling", "microbatch_weight"),
        ("sharded", "layout_of"),
    ],
)
def test_a_name_a_public_module_exported_in_0_4_resolves_with_a_deprecation_warning(module, name):
    public = importlib.import_module(f"accumjax.{module}")
    with pytest.warns(DeprecationWarning, match=rf"accumjax\.{module}\.{name} is internal.*0\.6"):
        value = getattr(public, name)
    assert name not in public.__all__ and callable(value)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        public.nothing_here  # noqa: B018


@pytest.mark.parametrize(
    ("module", "name", "where", "new_name"),
    [
        ("sharded", "Layout", "_mesh", "MeshLayout"),
        ("sharded", "gather", "_mesh", "gather_params"),
        ("sharded", "place", "_mesh", "lay_out"),
        ("window", "empty_like", "_window", "emptied_window"),
        ("accumulation_state", "unwrap", "_state", "accumulation_state_in"),
    ],
)
def test_a_renamed_0_4_name_resolves_to_its_new_name_with_a_deprecation_warning(
    module, name, where, new_name
):
    public = importlib.import_module(f"accumjax.{module}")
    with pytest.warns(DeprecationWarning, match=rf"accumjax\.{where}\.{new_name}"):
        value = getattr(public, name)
    assert value is getattr(importlib.import_module(f"accumjax.{where}"), new_name)


@pytest.mark.parametrize(
    ("module", "name", "where", "top_level"),
    [
        ("accumulation", "AccumulationState", "accumulation_state", True),
        ("distributed", "count_collectives", "collectives", False),
        ("batch_norm", "convert_batch_norm_variables", "batch_norm_convert", True),
    ],
)
def test_a_name_another_public_module_exports_warns_naming_where_to_import_it_from(
    module, name, where, top_level
):
    public = importlib.import_module(f"accumjax.{module}")
    keeper = importlib.import_module(f"accumjax.{where}")
    moved = rf"accumjax\.{module}\.{name} moved: import it from accumjax\.{where} "
    new_path = rf"\(accumjax\.{where}\.{name}\b.*0\.6"
    with pytest.warns(DeprecationWarning, match=moved + new_path) as seen:
        value = getattr(public, name)
    # The top-level spelling is named too where the package exports the name.
    assert (f" or accumjax.{name})" in str(seen[0].message)) == top_level
    assert value is getattr(keeper, name)
    assert name not in public.__all__ and name in keeper.__all__
    assert (name in importlib.import_module("accumjax").__all__) == top_level


def test_no_public_module_re_exports_another_public_modules_name():
    owners: dict[int, set[str]] = {}
    for path in PACKAGE:
        if path.stem.startswith("_"):
            continue
        module = importlib.import_module(f"accumjax.{path.stem}")
        for name in module.__all__:
            owners.setdefault(id(getattr(module, name)), set()).add(f"{path.stem}.{name}")
    assert [sorted(o) for o in owners.values() if len(o) > 1] == []


def test_the_0_4_scatter_markers_of_accumjax_window_resolve_with_a_deprecation_warning():
    import jax.numpy as jnp

    window = importlib.import_module("accumjax.window")
    with pytest.warns(DeprecationWarning, match=r"window\.REDUCED is no longer read"):
        assert window.REDUCED == -1
    with pytest.warns(DeprecationWarning, match=r"accumjax\.window\.reduced_scatter"):
        scatter = window.reduced_scatter
    like = {"b": jnp.zeros(2), "w": jnp.zeros((4, 2))}
    assert scatter({"b": None, "w": 0}, like) == {"b": -2, "w": -1}
    with pytest.raises(AttributeError):
        importlib.import_module("accumjax.scaling").REDUCED  # noqa: B018


def test_the_0_4_policy_of_accumjax_window_resolves_with_a_warning_and_builds_a_config():
    import jax.numpy as jnp

    from accumjax._config import Config

    window = importlib.import_module("accumjax.window")
    with pytest.warns(DeprecationWarning, match=r"accumjax\.window\.Policy .*0\.6"):
        policy = window.Policy
    config = policy(scaling="sum", max_norm=1.0, on_nonfinite="skip_window")
    assert isinstance(config, Config) and config.every_k == 1 and config.axis_name is None
    assert (config.scaling, config.max_norm, config.on_nonfinite) == ("sum", 1.0, "skip_window")
    assert config.reads and config.detects and policy().scaling == "mean"
    with pytest.warns(DeprecationWarning, match=r"accumjax\.window\.inspect_microbatch"):
        inspect = window.inspect_microbatch
    m = inspect(policy(), {"w": jnp.array([1.0, jnp.nan])})
    assert not bool(m.added) and bool(m.nonfinite)
