"""The README's Python examples run as written (blocks fenced ```python; ```py blocks are
sketches with elided bodies)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2

    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102

    out = capsys.readouterr().out
    assert out.strip()
    assert namespace["sub"].body[0].out_features == 32
