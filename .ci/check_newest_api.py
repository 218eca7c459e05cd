"""Check that the jax, flax and optax names accumjax uses exist in the newest releases.

CI tests accumjax against the newest jax/flax/optax that install on its Python (3.11), but
jax >= 0.11 and flax >= 0.12.9 need Python 3.12. This check covers the releases the tests
cannot run: it downloads the newest jax, flax and optax wheels the registry serves (for a
newer Python, without installing them), collects every ``jax...``, ``flax...`` and
``optax...`` name that ``accumjax/*.py`` uses, and looks each one up in the wheels' source.

Names are collected from the source with ``ast``: ``import jax.numpy as jnp`` and
``from flax import linen as nn`` make ``jnp`` and ``nn`` aliases of ``jax.numpy`` and
``flax.linen``; each import (``from jax.sharding import Mesh`` gives ``jax.sharding.Mesh``) and
each attribute chain rooted at an alias (``jnp.float32``, ``nn.Module``,
``jax.tree.map``) is one path.

Names are resolved statically, module by module, from the unpacked wheels (nothing is
imported): a name exists in a module if its source defines it (def, class, assignment),
imports it or re-exports it (``from x import *`` is followed), or if it is a submodule
file. ``if TYPE_CHECKING:`` blocks do not count, and ``del`` removes a name. A path is
followed while its names are modules; at the first name that is not a module (a function,
class or object) the rest of the path (``jax.config`` + ``.update``) is attributes of an
object and is not checked. Each path ends with one status:

* ``ok``: every module step resolves (the unchecked object tail, if any, is printed);
* ``deprecated``: the name is in the module's ``_deprecations`` table (jax's and optax's
  lazy deprecation mechanism): it still works but warns, and will go;
* ``removed``: in ``_deprecations`` with no value (accessing it raises, with a message);
* ``missing``: not defined, imported or re-exported anywhere in the module;
* ``unresolved``: the check cannot tell (the module is not in the wheels, or it defines a
  ``__getattr__`` of its own that may provide names lazily); printed, not a failure.

``main()`` prints every path it checked with its status and exits 1 when any is
``missing``, ``removed`` or ``deprecated`` (deprecations fail, as the tests' warning filters
make them fail under the versions CI installs), 2 when the download fails, 0 otherwise.

Usage::

    python .ci/check_newest_api.py                    # download the newest wheels
    python .ci/check_newest_api.py --wheels DIR       # use wheels (or unpacked ones) in DIR
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

#: The packages whose names are checked: their names are the roots of the collected paths.
ROOTS: tuple[str, ...] = ("jax", "flax", "optax")
#: The Python the wheels are downloaded for: newer than CI's 3.11, so that releases needing
#: Python 3.12+ (jax >= 0.11, flax >= 0.12.9) are the ones chosen.
DEFAULT_PYTHON = "3.13"
#: How many ``from x import *`` levels are followed before giving up (``unresolved``).
MAX_STAR_DEPTH = 8

Status = Literal["ok", "deprecated", "removed", "missing", "unresolved"]
#: Statuses that make ``main()`` fail.
FAILING: frozenset[str] = frozenset({"deprecated", "removed", "missing"})


# ----------------------------------------------------------------------------------------
# Collecting the names accumjax uses
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Use:
    """One dotted path (``jax.numpy.float32``) used at one place (``accumjax/x.py:12``)."""

    path: str
    where: str


def _root(name: str) -> str:
    return name.split(".", 1)[0]


def collect_uses(source: str, filename: str, roots: Iterable[str] = ROOTS) -> list[Use]:
    """The dotted paths under ``roots`` that one module's source uses, in source order.

    Every import of a module under ``roots`` is a use (``import jax.numpy as jnp`` uses
    ``jax.numpy``; ``from flax import nnx`` uses ``flax.nnx``) and binds an alias; every
    maximal attribute chain rooted at an alias (``jnp.zeros``, ``jax.tree.map``) is a use of
    the alias's path plus the attributes. Imports inside functions count too, and an alias
    is known to the whole file (shadowing by a local of the same name is not tracked).
    """
    roots = frozenset(roots)
    tree = ast.parse(source, filename=filename)
    aliases: dict[str, str] = {}
    uses: list[Use] = []

    def add(path: str, node: ast.AST) -> None:
        uses.append(Use(path, f"{filename}:{getattr(node, 'lineno', 0)}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root(alias.name) not in roots:
                    continue
                add(alias.name, node)
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:  # `import jax.numpy` binds `jax`
                    aliases[_root(alias.name)] = _root(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level or not node.module or _root(node.module) not in roots:
                continue
            for alias in node.names:
                if alias.name == "*":
                    add(node.module, node)
                    continue
                path = f"{node.module}.{alias.name}"
                add(path, node)
                aliases[alias.asname or alias.name] = path

    # Maximal attribute chains: skip an Attribute that is the value of another Attribute.
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        attrs: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            attrs.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            add(".".join([aliases[base.id], *reversed(attrs)]), node)
    uses.sort(key=lambda u: (int(u.where.rsplit(":", 1)[1]), u.path))
    return uses


def collect_package_uses(package_dir: Path, roots: Iterable[str] = ROOTS) -> dict[str, list[str]]:
    """Every path under ``roots`` that the ``*.py`` files of ``package_dir`` use.

    Returns ``{path: [places]}`` sorted by path; places are ``file:line``, relative to the
    directory above ``package_dir``.
    """
    found: dict[str, list[str]] = {}
    base = package_dir.parent
    for file in sorted(package_dir.rglob("*.py")):
        rel = file.relative_to(base).as_posix()
        for use in collect_uses(file.read_text(encoding="utf-8"), rel, roots):
            found.setdefault(use.path, []).append(use.where)
    return dict(sorted(found.items()))


# ----------------------------------------------------------------------------------------
# Resolving names in unpacked wheels
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    """What a module-level name is bound to: a module of the tree, or any other object."""

    kind: Literal["module", "object"]
    #: The module's dotted name (kind "module"), or where the object comes from.
    target: str


@dataclass
class ModuleInfo:
    """The module-level names of one module's source, read statically."""

    name: str
    bindings: dict[str, Binding] = field(default_factory=dict)
    #: ``from x import *`` sources, in order (dotted module names).
    star_imports: list[str] = field(default_factory=list)
    #: ``_deprecations`` entries: name -> True when it still has a value (deprecated),
    #: False when its value is None (removed).
    deprecations: dict[str, bool] = field(default_factory=dict)
    #: The module binds ``__getattr__`` to something other than jax's/optax's
    #: ``deprecation_getattr`` (it may provide any name lazily).
    custom_getattr: bool = False
    #: ``__all__`` when it is a literal list or tuple of strings.
    all_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Resolution:
    """The result of looking one dotted path up."""

    path: str
    status: Status
    #: The longest prefix of ``path`` that resolved.
    resolved: str
    #: What was found or why not, for the report.
    note: str = ""


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``<anything>.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


class WheelTree:
    """Unpacked wheels (``jax/``, ``flax/``, ... side by side) whose modules are read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, ModuleInfo | None] = {}

    # -- files ---------------------------------------------------------------------------

    def module_file(self, module: str) -> Path | None:
        """The source file of a dotted module name, or None when the tree has no such module."""
        base = self.root.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def has_module(self, module: str) -> bool:
        return self.module_file(module) is not None

    # -- one module's names --------------------------------------------------------------

    def module(self, name: str) -> ModuleInfo | None:
        """The names a module's source binds at module level (cached), or None if absent."""
        if name not in self._modules:
            file = self.module_file(name)
            self._modules[name] = None if file is None else self._read(name, file)
        return self._modules[name]

    def _absolute(self, module: str, is_package: bool, level: int, target: str | None) -> str:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        if level > 1:
            parts = parts[: len(parts) - (level - 1)]
        return ".".join([*parts, target] if target else parts)

    def _read(self, name: str, file: Path) -> ModuleInfo:
        info = ModuleInfo(name)
        is_package = file.name == "__init__.py"
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        info.bindings = self._run(tree.body, {}, info, name, is_package)
        return info

    def _run(
        self,
        body: Sequence[ast.stmt],
        bindings: dict[str, Binding],
        info: ModuleInfo,
        module: str,
        is_package: bool,
    ) -> dict[str, Binding]:
        """Apply ``body``'s statements in order to ``bindings`` (a new dict is returned).

        Branches (if/else, try/except) are each run from the same start and their results
        merged: a name bound in any branch may exist. ``if TYPE_CHECKING:`` bodies are
        skipped (their ``else`` runs). Function and class bodies are not entered.
        """
        b = dict(bindings)
        for stmt in body:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        b[alias.asname] = self._module_or_object(alias.name)
                    else:
                        top = _root(alias.name)
                        b[top] = Binding("module", top)
            elif isinstance(stmt, ast.ImportFrom):
                source = (
                    self._absolute(module, is_package, stmt.level, stmt.module)
                    if stmt.level
                    else stmt.module or ""
                )
                for alias in stmt.names:
                    if alias.name == "*":
                        info.star_imports.append(source)
                        continue
                    sub = f"{source}.{alias.name}"
                    b[alias.asname or alias.name] = (
                        Binding("module", sub)
                        if self.has_module(sub)
                        else Binding("object", f"from {source}")
                    )
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                b[stmt.name] = Binding("object", "defined here")
                if stmt.name == "__getattr__":
                    info.custom_getattr = True
            elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = [n for t in targets for n in _target_names(t)]
                for n in names:
                    b[n] = Binding("object", "assigned here")
                value = stmt.value
                if "__getattr__" in names and not (
                    isinstance(value, ast.Call) and "deprecation_getattr" in ast.unparse(value.func)
                ):
                    info.custom_getattr = True
                if "_deprecations" in names and isinstance(value, ast.Dict):
                    self._read_deprecations(value, info)
                if "__all__" in names and isinstance(value, ast.List | ast.Tuple):
                    strings = [
                        e.value
                        for e in value.elts
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    ]
                    if len(strings) == len(value.elts):
                        info.all_names = tuple(strings)
            elif isinstance(stmt, ast.Delete):
                for t in stmt.targets:
                    for n in _target_names(t):
                        b.pop(n, None)
            elif isinstance(stmt, ast.If):
                if _is_type_checking(stmt.test):
                    b = self._run(stmt.orelse, b, info, module, is_package)
                else:
                    b = self._merge(
                        self._run(stmt.body, b, info, module, is_package),
                        self._run(stmt.orelse, b, info, module, is_package),
                    )
            elif isinstance(stmt, ast.Try):
                branches = [self._run(stmt.body + stmt.orelse, b, info, module, is_package)]
                branches += [self._run(h.body, b, info, module, is_package) for h in stmt.handlers]
                b = self._merge(*branches)
                b = self._run(stmt.finalbody, b, info, module, is_package)
            elif isinstance(stmt, ast.With | ast.For | ast.While):
                b = self._merge(b, self._run(stmt.body, b, info, module, is_package))
                if isinstance(stmt, ast.For):
                    for n in _target_names(stmt.target):
                        b[n] = Binding("object", "loop variable")
        return b

    @staticmethod
    def _merge(*branches: dict[str, Binding]) -> dict[str, Binding]:
        merged: dict[str, Binding] = {}
        for branch in branches:
            for k, v in branch.items():
                # A name that is a module in one branch and an object in another: keep the
                # module, so that the path is followed (it resolves, or it is reported).
                if k not in merged or v.kind == "module":
                    merged[k] = v
        return merged

    def _module_or_object(self, dotted: str) -> Binding:
        return Binding("module", dotted) if self.has_module(dotted) else Binding("object", dotted)

    @staticmethod
    def _read_deprecations(table: ast.Dict, info: ModuleInfo) -> None:
        for key, value in zip(table.keys, table.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            removed = (
                isinstance(value, ast.Tuple)
                and len(value.elts) == 2
                and isinstance(value.elts[1], ast.Constant)
                and value.elts[1].value is None
            )
            info.deprecations[key.value] = not removed

    # -- looking a name up ---------------------------------------------------------------

    def lookup(self, module: str, name: str, depth: int = 0) -> Binding | Status | None:
        """What ``name`` is in ``module``: a Binding, a status, or None (not there).

        A status is returned for names that are not simply bound: ``deprecated`` or
        ``removed`` (in ``_deprecations``), ``unresolved`` (the module is not in the tree,
        a star import is too deep, or the module has a custom ``__getattr__``).
        """
        info = self.module(module)
        if info is None:
            return "unresolved"
        if name in info.bindings:
            return info.bindings[name]
        if name in info.deprecations:
            return "deprecated" if info.deprecations[name] else "removed"
        if self.has_module(f"{module}.{name}"):
            return Binding("module", f"{module}.{name}")
        for source in info.star_imports:
            if depth >= MAX_STAR_DEPTH:
                return "unresolved"
            src = self.module(source)
            if src is None:
                return "unresolved"
            if src.all_names is not None and name not in src.all_names:
                continue
            if src.all_names is None and name.startswith("_"):
                continue
            found = self.lookup(source, name, depth + 1)
            if found is not None:
                return found
        if info.custom_getattr:
            return "unresolved"
        return None

    def resolve(self, path: str) -> Resolution:
        """Look a dotted path up, one module step at a time (see the module docstring)."""
        parts = path.split(".")
        if not self.has_module(parts[0]):
            return Resolution(path, "unresolved", "", f"package {parts[0]} is not in the wheels")
        current = parts[0]
        for i, name in enumerate(parts[1:], start=1):
            found = self.lookup(current, name)
            prefix = ".".join(parts[: i + 1])
            done = ".".join(parts[:i])
            if found is None:
                return Resolution(path, "missing", done, f"{current} has no {name}")
            if isinstance(found, str):
                notes = {
                    "deprecated": f"{prefix} is deprecated in {current}._deprecations",
                    "removed": f"{prefix} was removed ({current}._deprecations)",
                    "unresolved": f"cannot tell whether {current} has {name}",
                }
                return Resolution(
                    path, found, done if found == "unresolved" else prefix, notes[found]
                )
            if found.kind == "object":
                rest = ".".join(parts[i + 1 :])
                note = f"attribute .{rest} of an object, not checked" if rest else ""
                return Resolution(path, "ok", prefix, note)
            if not self.has_module(found.target):
                rest = ".".join(parts[i + 1 :])
                note = f"module {found.target} is outside the wheels"
                return Resolution(path, "ok" if not rest else "unresolved", prefix, note)
            current = found.target
        return Resolution(path, "ok", path)


# ----------------------------------------------------------------------------------------
# Wheels
# ----------------------------------------------------------------------------------------


def download_wheels(dest: Path, packages: Sequence[str], python_version: str) -> None:
    """Download the newest wheels of ``packages`` for ``python_version`` (no dependencies)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", python_version, "-d", str(dest),
        *packages,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def unpack_wheels(source: Path, dest: Path) -> list[str]:
    """Unzip every ``*.whl`` in ``source`` into ``dest``; returns the wheels' file names."""
    names = []
    for wheel in sorted(source.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
        names.append(wheel.name)
    return names


def wheel_versions(tree: Path) -> dict[str, str]:
    """``{project: version}`` from the ``*.dist-info`` folders of an unpacked tree."""
    versions: dict[str, str] = {}
    for info in sorted(tree.glob("*.dist-info")):
        project, _, version = info.name[: -len(".dist-info")].partition("-")
        versions[project] = version
    return versions


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------


def check(tree: WheelTree, uses: dict[str, list[str]]) -> list[Resolution]:
    """Resolve every used path; one Resolution per path, in the order of ``uses``."""
    return [tree.resolve(path) for path in uses]


def report(results: Sequence[Resolution], uses: dict[str, list[str]]) -> str:
    """The lines ``main()`` prints: one per path, then a count by status."""
    lines = []
    for r in results:
        place = uses[r.path][0] + (f" (+{len(uses[r.path]) - 1})" if len(uses[r.path]) > 1 else "")
        note = f"  [{r.note}]" if r.note else ""
        lines.append(f"  {r.status:<10} {r.path}  ({place}){note}")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"{len(results)} names checked: {summary}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Download (or take) the newest wheels, check accumjax's names, print, return the code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    repo = Path(__file__).resolve().parent.parent
    parser.add_argument(
        "--source",
        type=Path,
        default=repo / "accumjax",
        help="the package whose names are checked (default: accumjax/)",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="a folder of wheels or unpacked wheels, instead of downloading",
    )
    parser.add_argument(
        "--python-version",
        default=DEFAULT_PYTHON,
        help=f"the Python the wheels are chosen for (default {DEFAULT_PYTHON})",
    )
    args = parser.parse_args(argv)

    uses = collect_package_uses(args.source)
    with tempfile.TemporaryDirectory(prefix="newest-api-") as tmp:
        unpacked = Path(tmp) / "unpacked"
        unpacked.mkdir()
        wheels = args.wheels
        if wheels is None:
            wheels = Path(tmp) / "wheels"
            try:
                download_wheels(wheels, ROOTS, args.python_version)
            except subprocess.CalledProcessError as err:
                print(f"check_newest_api: pip download failed ({err})", file=sys.stderr)
                return 2
        if any(wheels.glob("*.whl")):
            files = unpack_wheels(wheels, unpacked)
        else:  # already unpacked
            unpacked, files = wheels, []
        versions = wheel_versions(unpacked)
        shown = ", ".join(f"{p} {v}" for p, v in versions.items()) or ", ".join(files)
        print(
            f"check_newest_api: names from {args.source.name}/ against {shown}"
            + ("" if args.wheels else f" (newest wheels for Python {args.python_version})")
        )
        results = check(WheelTree(unpacked), uses)
    print(report(results, uses))
    bad = [r for r in results if r.status in FAILING]
    if bad:
        print(
            f"check_newest_api: FAILED: {len(bad)} name(s) deprecated, removed or missing "
            "in the newest releases:",
            file=sys.stderr,
        )
        for r in bad:
            print(
                f"  {r.status}: {r.path} ({r.note}); used at {', '.join(uses[r.path])}",
                file=sys.stderr,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
