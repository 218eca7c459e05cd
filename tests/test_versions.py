"""Newest releases: the dependency ranges, the deprecation guard and the newest-API check.

accumjax declares lower bounds only, so it installs beside the newest jax, flax and optax.
Two guards keep that honest: (a) the tests fail on a DeprecationWarning or FutureWarning
(``filterwarnings`` in ``pyproject.toml``), so a deprecation in the versions CI installs
is seen the day they install; (b) ``.ci/check_newest_api.py`` looks every jax/flax/optax
name accumjax uses up in the newest wheels, which need a newer Python than CI's. Its
name collection and resolution are tested here on small fake trees (no network).
"""

import importlib.util
import os
import subprocess
import sys
import tomllib
import warnings
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "check_newest_api.py"


@pytest.fixture(scope="module")
def api():
    """The ``.ci/check_newest_api.py`` module (the sdist ships tests/, not .ci/: skipped)."""
    if not SCRIPT.is_file():
        pytest.skip(f"{SCRIPT} is not here (an sdist?)")
    spec = importlib.util.spec_from_file_location("check_newest_api", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------
# pyproject.toml: lower bounds only
# ----------------------------------------------------------------------------------------


def _dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {(r := Requirement(line)).name: r for line in project["dependencies"]}


@pytest.mark.parametrize("name", ["jax", "flax", "optax", "numpy"])
def test_runtime_dependencies_have_no_upper_bound(name):
    operators = {spec.operator for spec in _dependencies()[name].specifier}
    assert operators & {"<", "<=", "~=", "==", "==="} == set(), operators


def test_lower_bounds_and_the_known_bad_optax_are_kept():
    deps = _dependencies()
    assert str(deps["jax"].specifier) == ">=0.10"
    assert str(deps["flax"].specifier) == ">=0.12.2"
    assert set(map(str, deps["optax"].specifier)) == {">=0.2.4", "!=0.2.7"}
    assert not deps["optax"].specifier.contains("0.2.7")
    assert deps["optax"].specifier.contains("0.3.0")  # a future release installs


# ----------------------------------------------------------------------------------------
# Guard (a): deprecation and future warnings are errors in the tests
# ----------------------------------------------------------------------------------------


def test_filterwarnings_make_deprecations_errors(request):
    filters = request.config.getini("filterwarnings")
    assert filters[:2] == ["error::DeprecationWarning", "error::FutureWarning"]
    # Every exception after them is an `ignore` for one named warning (message and module),
    # never a whole category.
    for entry in filters[2:]:
        action, message, _category, module = [*entry.split(":"), "", "", ""][:4]
        assert action == "ignore" and message and module, entry


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_a_deprecation_raised_in_a_test_is_an_error(category):
    with pytest.raises(category, match="going away"):
        warnings.warn("going away", category, stacklevel=1)


@pytest.mark.parametrize("module", ["jax._src.api", "flax.nnx.module", "optax._src.alias"])
def test_a_deprecation_attributed_to_jax_flax_or_optax_is_an_error(module):
    # What a library's `warnings.warn(..., stacklevel=1)` looks like to the filters.
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old API", DeprecationWarning, f"{module}.py", 1, module=module)


def test_a_deprecation_attributed_to_the_caller_is_an_error():
    # jax and flax warn with stacklevel=2 and more: the warning is attributed to the calling
    # module (accumjax's, or a test's), so the filters must not be restricted to jax's modules.
    def deprecated_api():
        warnings.warn("use new_api", DeprecationWarning, stacklevel=2)

    with pytest.raises(DeprecationWarning, match="new_api"):
        deprecated_api()


def test_the_jax_deprecation_mechanism_is_an_error():
    # jax's own path for a deprecated module attribute (jax._src.deprecations).
    deprecations = pytest.importorskip("jax._src.deprecations")
    if not hasattr(deprecations, "deprecation_getattr"):
        pytest.skip("this jax has no jax._src.deprecations.deprecation_getattr")
    getattr_ = deprecations.deprecation_getattr(
        "fake_module", {"old": ("fake_module.old is deprecated", lambda: None)}
    )
    with pytest.raises(DeprecationWarning, match=r"fake_module\.old"):
        getattr_("old")


def test_processes_a_test_starts_turn_deprecations_into_errors():
    # tests/conftest.py passes the same filters on in PYTHONWARNINGS (the examples and the
    # jax.distributed workers run in processes of their own).
    assert "error::DeprecationWarning,error::FutureWarning" in os.environ["PYTHONWARNINGS"]
    code = "import warnings; warnings.warn('going away', {}, stacklevel=1)"
    for category in ("DeprecationWarning", "FutureWarning"):
        proc = subprocess.run(
            [sys.executable, "-c", code.format(category)], capture_output=True, text=True
        )
        assert proc.returncode == 1 and f"{category}: going away" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------
# Guard (b): .ci/check_newest_api.py
# ----------------------------------------------------------------------------------------


def test_ci_runs_the_newest_api_check(api):
    assert "check_newest_api.py" in (ROOT / ".ci" / "run").read_text()


SOURCE = """\
import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from flax import linen as nn
from . import sibling
from accumjax import window

def f(x):
    import optax
    y = jnp.zeros(3).shape            # jax.numpy.zeros (the call ends the chain)
    z = jax.tree.map(np.abs, x)       # jax.tree.map; numpy is not checked
    return lax.psum(y, "i"), P(), optax.tree.where, window.Policy

class M(nn.Module):
    pass
"""


def test_collect_uses_follows_aliases_and_attribute_chains(api):
    uses = api.collect_uses(SOURCE, "pkg/m.py")
    assert [u.path for u in uses] == [
        "jax",
        "jax.numpy",
        "jax.lax",
        "jax.sharding.PartitionSpec",
        "flax.linen",
        "optax",
        "jax.numpy.zeros",
        "jax.tree.map",
        "jax.lax.psum",
        "optax.tree.where",
        "flax.linen.Module",
    ]
    assert uses[0].where == "pkg/m.py:2"
    assert uses[-1].where == "pkg/m.py:16"


def test_collect_package_uses_groups_places_by_path(api, tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import jax\nx = jax.jit\n")
    (pkg / "b.py").write_text("import jax\n\n\ny = jax.jit\n")
    assert api.collect_package_uses(pkg) == {
        "jax": ["pkg/a.py:1", "pkg/b.py:1"],
        "jax.jit": ["pkg/a.py:2", "pkg/b.py:4"],
    }


FAKE_TREE = {
    "jax/__init__.py": """\
from jax._src.api import jit as jit
from jax import numpy as numpy
from jax import lax
from jax._src.config import config as config
import typing as _typing

def _old():
    pass

_deprecations = {
    "old_fn": ("jax.old_fn is deprecated", _old),
    "gone": ("jax.gone was removed", None),
}
if _typing.TYPE_CHECKING:
    only_for_type_checkers = 1
else:
    from jax._src.deprecations import deprecation_getattr as _deprecation_getattr
    __getattr__ = _deprecation_getattr(__name__, _deprecations)
    del _deprecation_getattr
temporary = 1
del temporary
try:
    from jax._src.api import speedy
except ImportError:
    speedy = None
""",
    "jax/numpy/__init__.py": "from jax._src.numpy import *\nzeros = None\n",
    "jax/lax.py": "def psum(x, axis_name):\n    return x\n",
    "jax/tree.py": "from jax._src.tree import map as map\n",
    "jax/_src/__init__.py": "",
    "jax/_src/api.py": "def jit(f):\n    return f\n",
    "jax/_src/config.py": "config = object()\n",
    "jax/_src/deprecations.py": "def deprecation_getattr(module, table):\n    pass\n",
    "jax/_src/numpy.py": '__all__ = ["ones"]\n\ndef ones(): ...\n\ndef hidden(): ...\n',
    "jax/_src/tree.py": "def map(f, tree):\n    pass\n",
    "flax/__init__.py": "",
    "flax/nnx/__init__.py": (
        "from .module import Module as Module\n\n"
        "def __getattr__(name):\n    raise AttributeError(name)\n"
    ),
    "flax/nnx/module.py": "class Module:\n    pass\n\ndef first_from(*args):\n    pass\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    ("path", "status", "resolved"),
    [
        ("jax", "ok", "jax"),
        ("jax.jit", "ok", "jax.jit"),  # re-exported from a private module
        ("jax.numpy.zeros", "ok", "jax.numpy.zeros"),  # assigned
        ("jax.numpy.ones", "ok", "jax.numpy.ones"),  # through `import *` and __all__
        ("jax.numpy.hidden", "missing", "jax.numpy"),  # not in that __all__
        ("jax.lax.psum", "ok", "jax.lax.psum"),  # `from jax import lax`: a module
        ("jax.lax.pmax", "missing", "jax.lax"),
        ("jax.tree.map", "ok", "jax.tree.map"),  # a submodule file, not imported
        ("jax.config.update", "ok", "jax.config"),  # an object: .update is not checked
        ("jax.old_fn", "deprecated", "jax.old_fn"),
        ("jax.gone", "removed", "jax.gone"),
        ("jax.only_for_type_checkers", "missing", "jax"),  # TYPE_CHECKING does not count
        ("jax.temporary", "missing", "jax"),  # deleted
        ("jax.speedy", "ok", "jax.speedy"),  # bound in one branch of a try
        ("flax.nnx.Module", "ok", "flax.nnx.Module"),
        ("flax.nnx.module.first_from", "ok", "flax.nnx.module.first_from"),
        ("flax.nnx.Lazy", "unresolved", "flax.nnx"),  # a __getattr__ of its own
        ("optax.adam", "unresolved", ""),  # no optax in the tree
    ],
)
def test_resolve_on_a_fake_wheel_tree(api, tmp_path, path, status, resolved):
    tree = api.WheelTree(_write_tree(tmp_path, FAKE_TREE))
    result = tree.resolve(path)
    assert (result.status, result.resolved) == (status, resolved), result
    if path == "jax.config.update":
        assert "update" in result.note


def _fake_wheel(directory: Path, project: str, version: str, files: dict[str, str]) -> Path:
    wheel = directory / f"{project}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        zf.writestr(f"{project}-{version}.dist-info/METADATA", f"Name: {project}\n")
    return wheel


def test_unpack_wheels_and_read_their_versions(api, tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    out.mkdir()
    _fake_wheel(wheels, "jax", "9.9.9", {"jax/__init__.py": "jit = None\n"})
    _fake_wheel(wheels, "flax", "8.8", {"flax/__init__.py": ""})
    assert api.unpack_wheels(wheels, out) == [
        "flax-8.8-py3-none-any.whl",
        "jax-9.9.9-py3-none-any.whl",
    ]
    assert api.wheel_versions(out) == {"flax": "8.8", "jax": "9.9.9"}
    assert api.WheelTree(out).resolve("jax.jit").status == "ok"


@pytest.mark.parametrize(("used", "code"), [("jax.jit", 0), ("jax.pjit", 1), ("jax.gone", 1)])
def test_main_fails_on_a_missing_or_removed_name(api, tmp_path, capsys, used, code):
    wheels, pkg = tmp_path / "wheels", tmp_path / "pkg"
    wheels.mkdir()
    pkg.mkdir()
    files = {k: v for k, v in FAKE_TREE.items() if k.startswith("jax/")}
    _fake_wheel(wheels, "jax", "9.9.9", files)
    (pkg / "m.py").write_text(f"import jax\n\nf = {used}\n")
    assert api.main(["--wheels", str(wheels), "--source", str(pkg)]) == code
    out, err = capsys.readouterr()
    assert "jax 9.9.9" in out
    assert "2 names checked" in out
    assert (used in err) == bool(code)
