"""Multi-host runs on JAX's own multi-controller runtime (`jax.distributed`): starting it, and reading global
arrays back on the host.

Every process runs the same program over one global mesh (all processes' devices); JAX's coordination service
(started by process 0) connects them, and XLA's collectives (gloo on CPU, NCCL on GPU, ICI on TPU) move the data.
`initialize_distributed` must run before anything touches devices (`jax.devices()`, an array, a jit).

A lost process (killed, crashed, preempted) ends the others through JAX's coordination service (seen on jax
0.10.2 with 2 CPU processes; timings in bench/NOTES.md): when process 1 dies, process 0 (which hosts the service)
sees its heartbeats stop and is aborted (SIGABRT, exit status 134 in a shell) at most `heartbeat_timeout_s` later
(the service checks heartbeats periodically, so it can be sooner), wherever it is (a survivor inside a collective
waits for its peer until then); when process 0 dies, the others lose the service and are aborted at once. The
message is JAX's: "Terminating process because the JAX distributed service detected fatal errors. This most likely
indicates that another task died", with "The following tasks are unhealthy (stopped sending heartbeats): 1"
(task = process id) or "Failed to send RPC to coordination service. Either the leader task ..." (process 0 lost).
The abort cannot be caught in Python, so `failure_note` (printed by each process at the start) says beforehand
what it means and how to resume.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np

log = logging.getLogger("distill")


def launched_multi_host(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment names a multi-process launch that `jax.distributed.initialize()` detects: a
    JAX_COORDINATOR_ADDRESS, an `srun` step of several tasks (SLURM), an Open MPI world of several ranks, or a
    TPU pod slice of several hosts. A one-task SLURM allocation or a single TPU VM is not multi-host."""
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        value = env.get(name, "")
        return int(value) if value.isdigit() else 0

    return bool(env.get("JAX_COORDINATOR_ADDRESS")) or \
        ("SLURM_STEP_NODELIST" in env and count("SLURM_NTASKS") > 1) or count("OMPI_COMM_WORLD_SIZE") > 1 or \
        "," in env.get("TPU_WORKER_HOSTNAMES", "")


class DistributedError(RuntimeError):
    """A multi-host setting that cannot work (incomplete or out-of-range flags, a start after devices were
    touched): says which and what to do. A lost peer is reported by JAX itself (module docstring)."""


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How to start `jax.distributed`. `coordinator` ("HOST:PORT" of process 0), `num_processes` and `process_id`
    together launch by hand; `auto=True` calls `jax.distributed.initialize()` without them, so JAX reads them from
    the cluster (Cloud TPU pod slices, SLURM, Open MPI). `heartbeat_timeout_s`: a process that sends no heartbeat
    for this long is declared dead and the coordination service stops every other process with an error naming
    it (JAX's default is 100 s). `initialization_timeout_s`: how long to wait for every process to connect."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    heartbeat_timeout_s: int = 100
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        manual = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in manual) and any(v is None for v in manual):
            raise DistributedError("a multi-host launch by hand needs all three of coordinator (HOST:PORT), "
                                   f"num_processes and process_id; got coordinator={self.coordinator!r}, "
                                   f"num_processes={self.num_processes!r}, process_id={self.process_id!r}. "
                                   "Give all three, or auto=True (--distributed auto) on a TPU pod or SLURM.")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise DistributedError(f"coordinator {self.coordinator!r}: give HOST:PORT of process 0, e.g. "
                                       "10.0.0.2:8476.")
        if self.num_processes is not None and (self.num_processes < 1 or
                                               not 0 <= self.process_id < self.num_processes):
            raise DistributedError(f"process_id {self.process_id} must be in [0, {self.num_processes}) and "
                                   f"num_processes >= 1.")
        if self.auto and self.coordinator is not None:
            raise DistributedError("auto=True lets JAX detect the cluster; do not also give coordinator, "
                                   "num_processes and process_id.")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
            if getattr(self, name) < 1:
                raise DistributedError(f"{name} must be at least 1 second; got {getattr(self, name)}.")

    @property
    def requested(self) -> bool:
        """Whether these settings ask for a multi-host start."""
        return self.auto or self.coordinator is not None

    def initialize_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `jax.distributed.initialize` these settings make."""
        kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": int(self.heartbeat_timeout_s),
                                  "initialization_timeout": int(self.initialization_timeout_s)}
        if not self.auto and self.coordinator is not None:
            if self.num_processes is None or self.process_id is None:  # refused by __post_init__
                raise DistributedError("a coordinator needs num_processes and process_id.")
            kwargs.update(coordinator_address=self.coordinator, num_processes=int(self.num_processes),
                          process_id=int(self.process_id))
        return kwargs


def initialize_distributed(settings: DistributedSettings | None = None, **kwargs: Any) -> bool:
    """Start `jax.distributed` when the run is multi-host; a no-op on one host. Returns whether it started.

    With `settings` (or keyword arguments of `jax.distributed.initialize`), as asked; with neither, only when the
    environment names a multi-process launch JAX detects (`launched_multi_host`). Call it before
    anything touches devices: afterwards the device list is fixed and it raises DistributedError."""
    if settings is None:
        if not kwargs and not launched_multi_host():
            return False
        settings = DistributedSettings(auto=not kwargs)
    elif not settings.requested:
        return False
    if jax.distributed.is_initialized():
        return True
    call = {**settings.initialize_kwargs(), **kwargs}
    try:
        jax.distributed.initialize(**call)
    except RuntimeError as error:
        if "before" in str(error) or "backend" in str(error).lower():
            raise DistributedError("jax.distributed must start before anything touches devices; call "
                                   "distill.initialize_distributed first thing in the program (before "
                                   f"jax.devices(), arrays or jit). JAX said: {error}") from error
        raise
    log.info("jax.distributed started: process %d of %d, %d local and %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def failure_note(settings: DistributedSettings) -> str:
    """What this process says at the start of a multi-host run: who it is, and what a lost peer will look like
    (JAX's coordination service ends the survivors; its message names the lost task, which is the process id)."""
    return (f"distill: multi-host process {jax.process_index()} of {jax.process_count()} "
            f"({jax.local_device_count()} of {jax.device_count()} devices). If a process dies, JAX stops the "
            f"others within about {settings.heartbeat_timeout_s} s (heartbeat_timeout_s; at once when process 0 "
            "dies) with 'Terminating process because the JAX distributed service detected fatal errors', "
            "naming the lost task (= process id) as having stopped sending heartbeats; restart every process "
            "with the same command (--resume) to continue from the last checkpoint.")


def is_main_process() -> bool:
    """Process 0: the one that prints, writes logs and reports."""
    return jax.process_index() == 0


def say(line: str) -> None:
    """Print `line` on process 0 only (progress lines of a multi-host run appear once)."""
    if is_main_process():
        print(line, flush=True)


def to_host(value: Any) -> np.ndarray:
    """A jax.Array as numpy on every process: directly when this process holds all of it (replicated or
    single-host), else gathered from all processes (a collective: every process must call it)."""
    if not isinstance(value, jax.Array) or value.is_fully_addressable:
        return np.asarray(jax.device_get(value))
    if value.is_fully_replicated:
        return np.asarray(value.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def local_rows(array: jax.Array, axis: int = 0) -> np.ndarray:
    """This process's rows (along `axis`) of a global batch array split over the data axes: what it passed to
    `put_batch`, read back without a collective (for re-splitting a batch, e.g. after an out-of-memory error).
    On one host, the whole array."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    blocks: dict[tuple, np.ndarray] = {}
    for shard in array.addressable_shards:
        span = shard.index[axis]
        start = 0 if span.start is None else span.start
        blocks.setdefault((start, span.stop), np.asarray(shard.data))
    spans = sorted(blocks)
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise DistributedError(f"this process's rows of a batch are not one range along axis {axis} ({spans}); "
                               "a batch's data axes must split processes into contiguous row ranges.")
    return np.concatenate([blocks[span] for span in spans], axis=axis)


__all__ = ["DistributedError", "DistributedSettings", "initialize_distributed", "is_main_process", "to_host",
           "failure_note", "launched_multi_host", "local_rows"]
