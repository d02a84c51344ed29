"""The Python examples of the guides that are complete programs run as written: each
```python block of these pages runs in a fresh interpreter (in a scratch directory) and
must exit cleanly and print what its comments promise."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# guides whose every python block is a complete program (the others show fragments)
RUNNABLE_GUIDES = ["dht.md", "network.md", "moe.md"]
# what each block must print (a piece of its output per block, in order)
EXPECTED = {
    "dht.md": ["ValueWithExpiration(value=1.25", "{'a': 1, 'b': 2, 'c': None}", "2.5"],
    "network.md": ["5 1000000", "total 45\n[1, 2, 3]", "'you said': 'hi'", "virtual s"],
    "moe.md": ["ffn.0 None", "torch.Size([8, 64]) tensor(True)"],
}


def _blocks(guide: str) -> list[str]:
    text = (ROOT / "docs" / guide).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.mark.parametrize("guide", RUNNABLE_GUIDES)
def test_guide_examples_run_as_written(guide, tmp_path):
    blocks = _blocks(guide)
    assert len(blocks) == len(EXPECTED[guide]), f"{guide}: update EXPECTED for its examples"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for index, (code, expected) in enumerate(zip(blocks, EXPECTED[guide], strict=True)):
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        where = f"{guide}, example {index + 1}"
        assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
        assert expected in result.stdout, f"{where} printed:\n{result.stdout}"
