"""Sphinx configuration for the accumjax documentation.

Why Sphinx: ``autodoc`` + ``napoleon`` read the Google-style docstrings (Args, Returns,
Example) that the package already has and that ``tests/test_docstrings.py`` runs, and
``myst-parser`` lets the guides be plain Markdown. It is the same stack as the optax and
flax documentation, so the pages look and link like those our users already read.

The API reference (``api.rst``) is written here at build time from ``accumjax.__all__``:
a name added to ``__all__`` appears in the reference without editing any page, and
``tests/test_docs.py`` checks the generated source covers every public name.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document this checkout, not an installed copy

import accumjax  # noqa: E402

project = "accumjax"
author = "accumjax contributors"
copyright = "accumjax contributors"
release = accumjax.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Docstrings are Google style; attributes of NamedTuple states are listed in the class
# docstring's "Attributes:" section, rendered as one field list.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_attr_annotations = False  # the Attributes sections say the types in words
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# Module-level aliases keep their names in signatures instead of being expanded.
autodoc_type_aliases = {
    "Schedule": "Schedule",
    "Mask": "Mask",
    "LossFn": "LossFn",
}
autodoc_default_options = {"members": True, "show-inheritance": False}

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"accumjax {release}"
html_static_path: list[str] = []

# No intersphinx: CI machines reach package registries only, and a failed inventory fetch
# would be a warning (and -W makes warnings errors).

# Sections of the API page, by defining module. A public name from a module not listed
# here still appears, in a section named after its module.
SECTIONS = {
    "accumjax.accumulation": "Accumulation",
    "accumjax.accumulation_state": "Accumulation",
    "accumjax._state": "Accumulation",
    "accumjax.train_state": "Train step",
    "accumjax.train_step": "Train step",
    "accumjax._host": "Train step",
    "accumjax.batch_norm": "BatchNorm (linen)",
    "accumjax.batch_norm_convert": "BatchNorm (linen)",
    "accumjax.nnx_batch_norm": "BatchNorm (NNX)",
    "accumjax.clipping": "Clipping",
    "accumjax._norms": "Clipping",
    "accumjax.loss_scale": "Mixed precision and loss scaling",
    "accumjax.distributed": "Distributed helpers",
    "accumjax.collectives": "Distributed helpers",
    "accumjax.planner": "Microbatch planner",
}

API_HEADER = """\
API reference
=============

Everything below is importable from the top-level package (``import accumjax``). This
page is generated from ``accumjax.__all__`` when the documentation is built.

.. currentmodule:: accumjax
"""


def documented_path(name: str) -> str:
    """Where the API page documents the public name ``accumjax.<name>``.

    ``accumjax.<name>`` itself, except for a class or function exported under another name
    than its own (``NNXAccumBatchNorm = nnx_batch_norm.AccumBatchNorm``): autodoc would
    render ``accumjax.<name>`` as a bare "alias of ...", so the object is documented at its
    defining path and the page says which public name it has.
    """
    obj = getattr(accumjax, name)
    own = getattr(obj, "__name__", name)
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and own != name:
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"accumjax.{name}"


def _entry(name: str) -> str:
    obj = getattr(accumjax, name)
    path = documented_path(name)
    if inspect.ismodule(obj):
        return f".. automodule:: {obj.__name__}\n"
    if inspect.isclass(obj):
        directive = "autoclass"
    elif callable(obj):
        directive = "autofunction"
    else:
        directive = "autodata"
    text = f".. {directive}:: {path}\n"
    if path != f"accumjax.{name}":
        text = f".. public name: accumjax.{name}\n\n``accumjax.{name}`` is:\n\n" + text
    return text


def _section_of(name: str) -> str:
    obj = getattr(accumjax, name)
    if inspect.ismodule(obj):
        return obj.__name__
    return getattr(obj, "__module__", None) or "accumjax"


def api_page_source() -> str:
    """The reStructuredText of the API page: one autodoc entry per ``accumjax.__all__``."""
    groups: dict[str, list[str]] = {}
    for name in accumjax.__all__:
        title = SECTIONS.get(_section_of(name), _section_of(name))
        groups.setdefault(title, []).append(name)
    known = list(dict.fromkeys(SECTIONS.values()))
    order = [t for t in known if t in groups] + sorted(t for t in groups if t not in known)
    parts = [API_HEADER]
    for title in order:
        names = groups[title]
        parts.append(f"\n{title}\n{'-' * len(title)}\n")
        parts.append("\n.. autosummary::\n   :nosignatures:\n\n")
        parts.extend(f"   {documented_path(name).removeprefix('accumjax.')}\n" for name in names)
        for name in names:
            parts.append("\n" + _entry(name))
    return "".join(parts)


def write_api_page(_app=None) -> None:
    """Writes ``api.rst`` when its content changed (keeps incremental builds incremental)."""
    path = DOCS / "api.rst"
    text = api_page_source()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _skip_member(_app, what, name, obj, skip, _options):
    """Hides NamedTuple field accessors ("Alias for field number N"): the class docstring's
    Attributes section already describes each field."""
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return skip


# Expanded unions that read better under their usual names in signatures.
_P = r"~?(?:[\w]+\.)*"  # an optional ~ and module path before a name
_SIGNATURE_NAMES = [
    (re.compile(r"TypeAliasForwardRef\('(?:[\w.]+\.)?(\w+)'\)"), r"\1"),
    (
        re.compile(
            rf"str \| type\[{_P}Any\] \| {_P}dtype \| {_P}SupportsDType \| {_P}Any(?= |,|\)|$)"
        ),
        "Dtype",
    ),
    (
        re.compile(
            rf"{_P}Array \| {_P}ndarray \| {_P}bool \| {_P}number"
            r" \| bool \| int \| float \| complex"
        ),
        "ArrayLike",
    ),
    (re.compile(rf"{_P}Initializer \| {_P}Callable\[\[\.\.\.\], {_P}Any\]"), "Initializer"),
]


def _short_signature(_app, _what, _name, _obj, _options, signature, return_annotation):
    """Rewrites the expanded unions in a signature (see ``_SIGNATURE_NAMES``)."""

    def shorten(text):
        if text:
            for pattern, replacement in _SIGNATURE_NAMES:
                text = pattern.sub(replacement, text)
        return text

    return shorten(signature), shorten(return_annotation)


def _resolve_short_names(app, env, node, contnode):
    """Lets docstrings write :func:`accumulate` for the public ``accumjax.accumulate``."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    short = target.rsplit(".", 1)[-1]
    if short not in accumjax.__all__ or target == documented_path(short):
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], documented_path(short), node, contnode
    )


def setup(app):
    app.connect("builder-inited", write_api_page)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-signature", _short_signature)
    app.connect("missing-reference", _resolve_short_names)
    return {"parallel_read_safe": True}
