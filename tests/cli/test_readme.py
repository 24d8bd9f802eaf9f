"""The README's Python API example, run as written on the demo model (issue: it named a path no user has
and printed the chat template's end marker)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


@pytest.mark.smollm2
def test_python_api_example_runs_as_written(smollm2_dir):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=os.environ,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert "Paris" in r.stdout and "<|im_end|>" not in r.stdout
    assert lines[-1].endswith("tokens/s") and float(lines[-1].split()[0]) > 0
    assert any(line.endswith(("stop", "length")) for line in lines[:-1])
