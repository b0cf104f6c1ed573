"""Where the suite's inputs are: the repository, its tests' helpers and data, the shipped default
model, and the read-only goldens and configs in ../shared (never copied into the project)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
TEST_DATA = ROOT / "tests" / "data"
DEFAULT_MODEL = ROOT / "models" / "default"
SHARED = ROOT.parent / "shared"
GOLDENS = SHARED / "goldens"
HF_CONFIGS = SHARED / "hf-configs"
