"""Every Python example of docs/python-api.md runs as written (the real SmolLM2-135M), each in a
process of its own (one LLM per process at a time); the first one's greedy text equals
`spd generate`'s for the same prompt and options."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spd_engine.engine.runtime.launch import spd_command

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_the_page_has_examples():
    assert len(EXAMPLES) == 3


@pytest.mark.parametrize("k", range(len(EXAMPLES)))
def test_example_runs(k: int, smollm2_dir, tmp_path: Path) -> None:
    script = tmp_path / f"example{k}.py"
    script.write_text(EXAMPLES[k])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example printed nothing"
    if k == 0:  # the API's greedy text is `spd generate`'s
        cli = subprocess.run([*spd_command(), "generate", "--model", "smollm2-135m", "--stages", "2", "--colocate",
                              "--prompt", "The capital of France is", "--max-new-tokens", "24", "--quiet",
                              "--json", "-"], capture_output=True, text=True, timeout=600)
        assert cli.returncode == 0, cli.stderr[-3000:]
        import json

        text = json.loads(cli.stdout.strip().splitlines()[-1])["text"]
        assert f"'The capital of France is' -> {text!r}" in proc.stdout, (proc.stdout, text)
