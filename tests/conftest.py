"""Shared fixtures: the read-only goldens in ../shared (never copied into the project)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from paths import GOLDENS, HELPERS, HF_CONFIGS
from safetensors.numpy import load_file

# The suite compiles hundreds of small XLA:CPU programs, and compiling is most of its time: without
# LLVM's expensive passes and XLA:CPU's fusion emitters a compile is about twice as fast, and the
# tiny models' programs run a little slower. XLA:CPU's FAST_COMPILE preset with one codegen module
# per program takes 6-18% more off a test file's time (test_cache.py, test_continuous.py +
# test_psd.py, measured A/B), with the same tokens. Set before JAX starts; subprocesses inherit it.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_opt_preset=FAST_COMPILE --xla_cpu_parallel_codegen_split_count=1"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

# The command-line, multi-process and serving tests start processes that compile the programs other
# tests' processes already compiled (the shipped model's, at its recommended setting, above all).
# JAX's persistent compilation cache in one directory per pytest run (the xdist workers share the
# run's id; their subprocesses inherit the variables) hands each program over compiled. Only
# programs that took a second or more are written: writing every one (most are the tiny models'
# sub-second programs, never compiled twice) made test_cache.py 85 s instead of 76, and a program that
# fast costs a reader about what reading it back would. A size cap turns on the cache's file lock,
# so a process never reads an entry another is still writing; a miss only compiles. The directory
# is removed when the run ends (``pytest_sessionfinish``).
COMPILE_CACHE_ROOT = Path(tempfile.gettempdir()) / "psd-jax-test-compile-cache"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(COMPILE_CACHE_ROOT / _run_id)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)


# Every XLA:CPU program keeps a few hundred memory mappings of its code, and this suite compiles
# thousands: past the kernel's limit on mappings per process (vm.max_map_count, 65530 by default)
# the next compile crashes the interpreter. Programs are shared between tests through the
# shared fixtures' models; when the mappings near the limit, every model drops its programs (the later
# tests recompile what they need).
MAX_MAPPINGS = 40_000  # checked after each module
MAX_MAPPINGS_IN_A_MODULE = 55_000  # checked after each test


def mappings() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return maps.read().count(b"\n")


def _clear_every_program() -> None:
    import gc

    import jax

    from psd_jax.api import LoadedModel

    for obj in gc.get_objects():
        if issubclass(type(obj), LoadedModel):  # type(): isinstance reads __class__, which some modules warn on
            obj.clear_programs()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _bounded_compiled_programs():
    """Between modules: a module's servers and fixtures keep their programs while it runs (a server
    counts its compiles), and the next module starts below ``MAX_MAPPINGS``."""
    yield
    if os.path.exists("/proc/self/maps") and mappings() > MAX_MAPPINGS:
        _clear_every_program()


@pytest.fixture(autouse=True)
def _bounded_compiled_programs_within_a_module():
    """Within a module only near the kernel's limit, which one module's programs stay well below."""
    yield
    if os.path.exists("/proc/self/maps") and mappings() > MAX_MAPPINGS_IN_A_MODULE:
        _clear_every_program()


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when written to (a test's capture, or the terminal)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def _harness_log_to_this_tests_stderr():
    """The harness binds its log handler to the stderr of the test that first configured it (a
    captured stream, closed after that test); its warnings go to the running test's stderr, as in
    a process of its own."""
    import logging

    for handler in logging.getLogger("lm_eval").handlers if "lm_eval" in sys.modules else ():
        if type(handler) is logging.StreamHandler:  # the harness's own (pytest attaches subclasses here too)
            handler.stream = _CurrentStderr()  # not setStream: it flushes the old stream, which may be closed
    yield


def llada2_mini_config():
    """LLaDA2.0-mini's real config, with the special ids beside it (the real config.json names none)."""
    import json

    from models import config_from_dict

    mini = HF_CONFIGS / "LLaDA2.0-mini"
    ids = json.loads((mini / "special_ids.json").read_text())
    return config_from_dict(json.loads((mini / "config.json").read_text()), str(mini), ids)


@pytest.fixture(scope="session")
def cases() -> dict:
    return load_file(str(GOLDENS / "cases.safetensors"))


@pytest.fixture(scope="session")
def lms() -> dict:
    """The three tiny golden checkpoints, loaded once (float32)."""
    from psd_jax import load_model

    return {name: load_model(GOLDENS / name) for name in ("llada-tiny", "llada-tiny-gqa", "dream-tiny")}


@pytest.fixture(scope="session")
def llada2_cases() -> dict:
    """The LLaDA2.0 goldens (forward logits and ``generate`` cases of ``llada2-tiny``)."""
    return load_file(str(GOLDENS / "llada2_cases.safetensors"))


@pytest.fixture(scope="session")
def llada2_lm():
    """The tiny LLaDA2.0 golden checkpoint, loaded once (float32)."""
    from psd_jax import load_model

    return load_model(GOLDENS / "llada2-tiny")


@pytest.fixture(scope="session")
def lladamoe_cases() -> dict:
    """The LLaDA-MoE goldens (forward logits, LLaDA ``generate`` and Fast-dLLM threshold cases of ``lladamoe-tiny``)."""
    return load_file(str(GOLDENS / "lladamoe_cases.safetensors"))


@pytest.fixture(scope="session")
def lladamoe_lm():
    """The tiny LLaDA-MoE golden checkpoint, loaded once (float32)."""
    from psd_jax import load_model

    return load_model(GOLDENS / "lladamoe-tiny")


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def word_model(tmp_path_factory) -> Path:
    """llada-tiny with a word-level tokenizer, problems and a harness task (tests/helpers/word_model.py)."""
    from word_model import with_tokenizer

    return with_tokenizer(tmp_path_factory.mktemp("word-model") / "llada-tiny-words")


SHARED_RUN_TIMEOUT_S = 900  # the 8-device subprocess: about 3 minutes alone on two cores


def run_root(tmp_path_factory) -> Path:
    """A directory every worker of this pytest run shares (pytest-xdist: the workers' common base
    temporary directory; one process alone: its own), and no other run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class SharedRun:
    """tests/helpers/sharded_decode.py, run once per pytest run whichever worker asks first: the first
    worker to create ``claim`` starts the subprocess and, once it has finished, writes its record
    to ``result`` (under a temporary name, then renamed: it appears whole) or its failure to
    ``failed``; every other worker waits for one of the two files, with a deadline."""

    def __init__(self, root: Path):
        self.root = root
        self.claim, self.result, self.failed = root / "sharded.claim", root / "sharded.json", root / "sharded.failed"
        self.proc = None

    def start(self, word_model: Path) -> None:
        """Start the subprocess here if no worker has yet."""
        import subprocess

        try:
            os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        env = dict(
            os.environ,
            XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8",
            JAX_PLATFORMS="cpu",
            **OFFLINE,
        )
        out = self.root / "one-process"
        out.mkdir()
        script = HELPERS / "sharded_decode.py"
        args = [
            GOLDENS / "llada-tiny",
            GOLDENS / "llada2-tiny",
            word_model,
            out,
            GOLDENS / "sdar-tiny",
            GOLDENS / "diffusion-gemma-tiny",
        ]
        with (out / "stdout.txt").open("w") as stdout, (out / "stderr.txt").open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), *map(str, args)], env=env, stdout=stdout, stderr=stderr
            )

    def record(self) -> dict:
        """The subprocess's record: waited for here if this worker started it, else read once the
        worker that did has written it."""
        import json
        import time

        if self.proc is not None and not self.result.exists() and not self.failed.exists():
            out = self.root / "one-process"
            try:
                code = self.proc.wait(timeout=SHARED_RUN_TIMEOUT_S)
            except Exception:
                self.proc.kill()
                code = "killed after the deadline"
            if code == 0:
                record = {**json.loads((out / "stdout.txt").read_text().strip().splitlines()[-1]), "out": str(out)}
                part = self.result.with_suffix(".part")
                part.write_text(json.dumps(record))
                part.rename(self.result)
            else:
                self.failed.write_text(
                    f"tests/helpers/sharded_decode.py ended with {code}:\n" + (out / "stderr.txt").read_text()[-3000:]
                )
        deadline = time.monotonic() + SHARED_RUN_TIMEOUT_S
        while not (self.result.exists() or self.failed.exists()):
            assert time.monotonic() < deadline, (
                f"no record of tests/helpers/sharded_decode.py in {self.root} after {SHARED_RUN_TIMEOUT_S} s"
            )
            time.sleep(0.5)
        assert not self.failed.exists(), self.failed.read_text()
        return json.loads(self.result.read_text())

    def finish(self) -> None:
        """At this worker's end: a subprocess it started is seen to its end and its record written,
        since another worker may be waiting for it."""
        if self.proc is not None and not (self.result.exists() or self.failed.exists()):
            with contextlib.suppress(AssertionError):
                self.record()


@pytest.fixture(scope="session")
def sharded_process(word_model, tmp_path_factory):
    """tests/helpers/sharded_decode.py started in the background, once per pytest run (``SharedRun``):
    decodes on meshes of 8 simulated devices in one process (llada-tiny, llada2-tiny's expert
    meshes, serving on a mesh) and the command-line front ends there as one process (the
    multi-process tests' reference). Started early by the multi-process tests so that it runs while
    their two processes wait on each other."""
    shared = SharedRun(run_root(tmp_path_factory))
    shared.start(word_model)
    yield shared
    shared.finish()


@pytest.fixture(scope="session", autouse=True)
def shared_run_starts_with_the_session(request):
    """The 8-device subprocess started at each worker's first test (the first worker to claim it
    runs it), when any collected test needs it: it runs beside the other files' tests from the
    start instead of while the worker that first needs it waits."""
    needs = ("sharded_process", "sharded_run")
    if any(name in getattr(item, "fixturenames", ()) for item in request.session.items for name in needs):
        request.getfixturevalue("sharded_process")


@pytest.fixture(scope="session")
def sharded_run(sharded_process) -> dict:
    """``sharded_process``'s record, once it has finished."""
    return sharded_process.record()


@pytest.fixture(scope="session")
def torch_lms() -> dict:
    """The three tiny golden checkpoints in the PyTorch backend (float32, CPU), loaded once."""
    from psd_jax.torch_backend import load_torch_model

    return {
        name: load_torch_model(GOLDENS / name, device="cpu") for name in ("llada-tiny", "llada-tiny-gqa", "dream-tiny")
    }


@pytest.fixture(scope="module")
def torch_one_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("torch_one_thread")``):
    the backends are compared, not raced for the two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A tuned recommended setting (recommended.json) for a copy of a model directory: a plain
# threshold decode (cheap to compile) at a block length other than the shipped model's 16.
TUNED = {"policy": "threshold", "threshold": 0.7, "block_length": 8}


def model_with_recommendation(root: Path, source: Path, recommended: dict | str | None = None) -> Path:
    """``source``'s files linked into ``root`` with ``recommended.json`` holding ``recommended``
    (a dict: ``{"settings": recommended, "provenance": ...}``; text: written as is; None: no file)."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "recommended.json":  # written below, never through a link into the source
            (root / item.name).symlink_to(item)
    if isinstance(recommended, dict):
        body = {"settings": recommended, "provenance": {"data": "test.jsonl[:8]"}}
        (root / "recommended.json").write_text(json.dumps(body))
    elif recommended is not None:
        (root / "recommended.json").write_text(recommended)
    return root


@pytest.fixture(scope="session")
def tuned_model_dir(tmp_path_factory) -> Path:
    """The shipped model's directory with ``TUNED`` as its recommended.json."""
    from psd_jax.model_dir import DEFAULT_MODEL_DIR

    return model_with_recommendation(tmp_path_factory.mktemp("tuned") / "default", DEFAULT_MODEL_DIR, TUNED)


@pytest.fixture(scope="session")
def tuned_lm(tuned_model_dir):
    """One loaded model of ``tuned_model_dir``: the front ends under test get it instead of loading
    their own (``monkeypatch`` their ``load_model``), so each shape compiles once."""
    from psd_jax import load_model

    return load_model(tuned_model_dir)


# The suite runs in two workers, each test file whole in one (``-n 2 --dist loadfile``: a module's
# fixtures are built once); the one fixture several files share, the 8-device subprocess, is run once
# for both workers (``SharedRun``). The files whose fixtures run subprocesses are collected first;
# pytest-xdist's loadfile scheduler then hands files out by their number of tests (docs/contributing.md).
BACKGROUND_FIRST = ("test_multihost", "test_sharding", "test_device_check")


def pytest_collection_modifyitems(config, items):
    """Files in collection order, but ``BACKGROUND_FIRST`` first (pytest-xdist hands files to the
    workers in this order)."""

    def first(item) -> int:
        module = item.module.__name__.rpartition(".")[2]
        return BACKGROUND_FIRST.index(module) if module in BACKGROUND_FIRST else len(BACKGROUND_FIRST)

    items.sort(key=first)  # stable: each file's tests keep their order


def pytest_sessionfinish(session, exitstatus):
    """The run's compilation cache goes with the run (the controller's end: after every worker's);
    a directory the user set is theirs and stays."""
    cache = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
    if not os.environ.get("PYTEST_XDIST_WORKER") and cache.parent == COMPILE_CACHE_ROOT:
        shutil.rmtree(cache, ignore_errors=True)
