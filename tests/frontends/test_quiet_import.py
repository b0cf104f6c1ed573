"""A first run without torch (an optional extra: the default install has none) prints no
transformers advice that "PyTorch was not found", which reads like a failure to a newcomer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from paths import ROOT

ADVICE = "PyTorch was not found."
# Run by every Python started with this folder on PYTHONPATH: torch looks uninstalled to the import
# system and to ``importlib.util.find_spec`` (transformers' check), and the process reports at exit
# whether it imported transformers, so a run that never loads a tokenizer cannot pass by accident.
SITECUSTOMIZE = """import atexit, sys
sys.modules["torch"] = None
atexit.register(lambda: sys.stderr.write(f"transformers imported: {'transformers' in sys.modules}\\n"))
"""


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory):
    """Run ``python *args`` in the project root as if torch were not installed; returns the result."""
    hide = tmp_path_factory.mktemp("without_torch")
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), str(ROOT), os.environ.get("PYTHONPATH")]))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    return run


def test_transformers_without_torch_gives_the_advice(without_torch):
    """The setup reproduces an install without torch: transformers imported as is logs the advice."""
    out = without_torch("-c", "import transformers")
    assert out.returncode == 0, out.stderr
    assert ADVICE in out.stderr
    assert "transformers imported: True" in out.stderr


def test_generate_without_torch_prints_no_advice(without_torch):
    """``python -m psd_jax.generate`` on the shipped model (which has a tokenizer, so transformers is
    imported) decodes and prints no advice."""
    out = without_torch(
        "-m", "psd_jax.generate", "--prompt-ids", "1,2,3", "--gen-length", "4", "--block-length", "4", "--steps", "1"
    )
    assert out.returncode == 0, out.stderr
    assert "transformers imported: True" in out.stderr
    assert ADVICE not in out.stderr
