"""Several processes, one program: every front end on N processes under ``jax.distributed``.

JAX's multi-controller runtime runs one Python process per host (per TPU VM worker, per GPU node):
each process holds its own devices, and every process runs the same compiled programs on the same
global arrays, in the same order. A mesh then spans every process's devices
(``psd_jax.parallel.sharding``), parameters are read by each process only for the shards its devices hold
(``convert``), and results come back to every process (``to_host``). What differs between the
processes is what they say: only process 0 prints results and writes files (``is_main``).

The front ends take the same flags (``psd_jax.cli.flags.add_cluster_flags``): ``--coordinator HOST:PORT --num-processes N
--process-id I`` (all three, for a cluster JAX cannot detect: a GPU cluster, or N processes on one
machine), or ``--distributed`` alone (JAX's own detection: Cloud TPU pod slices, SLURM,
Open MPI). On a CPU backend the cross-process collectives go through gloo, so the same commands
run as N processes on one machine: that is how the tests run them.

A process that dies leaves the others waiting in a collective; JAX's coordination service then
ends every process within ``--heartbeat-timeout`` seconds ("Terminating process because the JAX
distributed service detected fatal errors"). The server notices sooner between calls
(``psd_jax.serve.lockstep``) and answers its clients before it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

DEFAULT_HEARTBEAT_S = 100  # jax.distributed.initialize's own default


class ClusterError(ValueError):
    """Multi-process flags that cannot start a cluster, with the reason."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins the others: explicitly (coordinator, count, id) or by JAX's detection."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S

    @property
    def detected(self) -> bool:
        return self.coordinator is None

    def describe(self) -> str:
        if self.detected:
            return "a cluster JAX detects"
        return f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator}"


def start(cluster: Cluster | None) -> None:
    """Join the cluster (``jax.distributed.initialize``) before anything touches a device."""
    import jax

    if cluster is None or jax.distributed.is_initialized():
        return

    # The CPU client's collectives between processes (accelerators have their own: NCCL, ICI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    options = {"heartbeat_timeout_seconds": cluster.heartbeat_timeout_s}
    if cluster.detected:
        jax.distributed.initialize(**options)
    else:
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id, **options)
    if jax.default_backend() == "cpu":
        _native_stdout_to_stderr()


def _native_stdout_to_stderr() -> None:
    """gloo prints a line to the C++ standard output each time it connects a group of processes
    ("[Gloo] Rank 0 is connected to 1 peer ranks..."), which would land in the middle of a front
    end's results (``--json`` lines). Native writes to file descriptor 1 go to standard error from
    here on; Python's ``sys.stdout`` keeps writing to the original standard output."""
    import sys

    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(original, "w", buffering=1, closefd=True)  # noqa: SIM115 (the process's stdout from now on)


def process_count() -> int:
    import jax

    return jax.process_count()


def is_main() -> bool:
    """Whether this process reports: prints results, writes files, serves HTTP (process 0)."""
    import jax

    return jax.process_index() == 0


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Standard output only on process 0 (the others run the same work and would repeat it)."""
    if is_main():
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def from_main(data: bytes) -> bytes:
    """Process 0's ``data`` on every process (the others' own ``data`` is ignored; one process:
    ``data`` itself). Two collectives (the length, then the bytes), so every process must call this
    in the same order: what a process reads or measures by itself (a file, a clock) becomes one value
    that every process decides on alike."""
    if process_count() == 1:
        return data
    from jax.experimental.multihost_utils import broadcast_one_to_all

    length = int(broadcast_one_to_all(np.int32(len(data) if is_main() else 0)))
    mine = np.frombuffer(data, np.uint8) if is_main() else np.zeros(length, np.uint8)
    return bytes(np.asarray(broadcast_one_to_all(mine), np.uint8)) if length else b""


def to_host(tree: Any) -> Any:
    """``tree``'s arrays as numpy arrays on every process. An array split over several processes'
    devices is first made whole on every device (one collective, compiled once per shape), so every
    process must call this in the same order, as it runs the decode itself."""
    import jax

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if not x.is_fully_replicated:
            x = _replicated(x)
        return np.asarray(x.addressable_data(0))

    return jax.tree.map(one, tree)


def _replicated(x):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = sorted(x.sharding.device_set, key=lambda d: d.id)
    whole = NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())
    return _gather_to(whole)(x)


@functools.cache
def _gather_to(sharding):
    """One jitted identity per target sharding, so each shape compiles once."""
    import jax

    return jax.jit(_identity, out_shardings=sharding)


def _identity(x):
    return x
