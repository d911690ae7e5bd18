"""The README's example runs as written, on whichever device this machine has."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_use_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "chosen:" in capsys.readouterr().out
