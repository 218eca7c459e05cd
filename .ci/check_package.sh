#!/usr/bin/env bash
# Builds the sdist and the wheel, checks the sdist's contents, installs the wheel (with its
# dependencies) into a fresh virtual environment and imports it from outside the repository.
# Usage: bash .ci/check_package.sh   (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip install -q build
"$PYTHON" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
  cat "$work/build.log"
  exit 1
}
wheel=$(ls "$work"/dist/accumjax-*.whl)
sdist=$(ls "$work"/dist/accumjax-*.tar.gz)
echo "built $(basename "$wheel") $(basename "$sdist")"

# The sdist carries the package, its py.typed marker, and what the tests and docs need.
listing="$work/sdist.txt"
tar -tzf "$sdist" >"$listing"
for path in accumjax/__init__.py accumjax/py.typed pyproject.toml README.md CHANGELOG.md \
  tests/conftest.py docs/conf.py; do
  grep -q "^accumjax-[^/]*/$path\$" "$listing" || {
    echo "sdist lacks $path" >&2
    exit 1
  }
done
if grep -qE "/docs/_build/|/docs/api\.rst$|__pycache__" "$listing"; then
  echo "sdist holds build outputs:" >&2
  grep -E "/docs/_build/|/docs/api\.rst$|__pycache__" "$listing" | head >&2
  exit 1
fi
# The wheel: the package and py.typed, nothing else at the top level.
"$PYTHON" - "$wheel" <<'PY'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "accumjax/py.typed" in names, "wheel lacks accumjax/py.typed"
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert tops == {"accumjax"}, f"wheel has unexpected top-level entries: {sorted(tops)}"
PY

# `python -m build` made the wheel from the sdist, so installing the wheel checks both.
# A fresh venv (no system site-packages): the wheel's declared dependencies must suffice.
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-compile "$wheel" # no .pyc: faster
cd "$work"         # outside the repository: import the installed copy, not the checkout
unset PYTHONPATH # (nor one that PYTHONPATH points at)
"$work/venv/bin/python" -c "import accumjax; print('accumjax', accumjax.__version__)"
"$work/venv/bin/python" -c "import accumjax, pathlib; \
assert (pathlib.Path(accumjax.__file__).parent / 'py.typed').exists(); \
assert '/venv/' in accumjax.__file__, accumjax.__file__"
echo "package check passed"
