"""Writing one folder from a multi-host run (`jax.distributed`): every process calls the writer together, process
0 alone writes (the folder is on shared storage), and every process returns once the folder is complete.

All processes meet before the write as well as after it: XLA:CPU's collectives abort a process that arrives more
than 30 s late to its first collective, and process 0 may write for minutes while the others wait at the second
barrier (measured on jax 0.10).
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import jax

from .safetensors_stream import CheckpointError

T = TypeVar("T")


def multi_host() -> bool:
    """Whether this is one of several processes of a `jax.distributed` run (without touching devices when not)."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def process_0_writes(dst: str, overwrite: bool, write: Callable[[], T], others: Callable[[], None] = lambda: None,
                     name: str = "write") -> str:
    """Process 0 runs `write()` into `dst`; every other process runs `others()` (its part of any collectives the
    write makes, in the same order) and waits until the folder is complete. A non-empty `dst` without `overwrite`
    is refused on every process (refused by process 0 alone, the others would wait for it forever)."""
    from jax.experimental import multihost_utils
    dst = os.path.abspath(dst)
    if not overwrite and os.path.isdir(dst) and os.listdir(dst):
        raise CheckpointError(f"{dst} exists and is not empty; pass overwrite=True to replace it (it is swapped "
                              "out only once the new folder is complete), or choose another folder.")
    multihost_utils.sync_global_devices(f"{name} start {dst}")
    if jax.process_index() == 0:
        write()
    else:
        others()
    multihost_utils.sync_global_devices(f"{name} {dst}")
    return dst


__all__ = ["multi_host", "process_0_writes"]
