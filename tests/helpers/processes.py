"""Commands run as users run them: ``python -m psd_jax.<front end>`` as one process, or as several
processes of one ``jax.distributed`` cluster on this machine (simulated CPU devices, collectives
through gloo), each with its output in files."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

from paths import ROOT

from conftest import OFFLINE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_flags(coordinator: str, processes: int, index: int) -> list[str]:
    return ["--coordinator", coordinator, "--num-processes", str(processes), "--process-id", str(index)]


@dataclasses.dataclass
class Run:
    """One process of a command: its process, and the files its standard output and error go to."""

    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.stdout.stem} still ran after {timeout_s} s:\n{self.log()}") from None

    def out(self) -> str:
        return self.stdout.read_text()

    def log(self) -> str:
        """The end of its standard error, without gloo's connection lines."""
        lines = self.stderr.read_text().splitlines()
        return "\n".join(line for line in lines if not line.startswith("[Gloo]"))[-3000:]


def start(module: str, argv: list[str], out: Path, name: str, *, devices: int, processes: int = 1) -> list[Run]:
    """``python -m module argv`` on ``processes`` processes of ``devices`` simulated CPU devices each
    (one process: no cluster flags), from the repository root; outputs under ``out`` as
    ``name-<process>.out`` and ``.err``."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        **OFFLINE,
    )
    coordinator = f"127.0.0.1:{free_port()}"
    runs = []
    for i in range(processes):
        flags = cluster_flags(coordinator, processes, i) if processes > 1 else []
        stdout, stderr = out / f"{name}-{i}.out", out / f"{name}-{i}.err"
        with stdout.open("w") as o, stderr.open("w") as e:
            command = [sys.executable, "-m", module, *argv, *flags]
            runs.append(Run(subprocess.Popen(command, cwd=ROOT, env=env, stdout=o, stderr=e), stdout, stderr))
    return runs


def finish(runs: list[Run], timeout_s: float) -> list[Run]:
    """Wait for every process of a command; each must exit 0."""
    for i, run in enumerate(runs):
        code = run.wait(timeout_s)
        assert code == 0, f"process {i} of {run.stdout.stem} ended with {code}:\n{run.log()}"
    return runs


def stop(runs: list[Run]) -> None:
    """Kill whatever still runs (a test's cleanup)."""
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
