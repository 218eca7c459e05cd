"""The README's Python blocks run as written, in order, in one namespace."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert int(namespace["state"].step) == 20  # the scan-mode quick start
    assert int(namespace["stream_state"].step) == 1  # stream mode with per-microbatch keys
    assert int(namespace["agc_state"].step) == 1  # the GradientAccumulateModel migration
