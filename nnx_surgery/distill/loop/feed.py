"""The training loop's batches: `grad_accum` data batches stacked into one step's micro-batches (A, B, T), the
on-policy loss masks and samples, split into the micro-batches the memory plan says (oom.py) and put on the mesh.

Each step's data batch is fingerprinted (`fingerprints.batch_digest`, logged as the step record's
`batch_digest`), so two phases that should read the same batches in the same order (a distillation and its
control) can be checked to have done so.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from .run_config import DistillConfig
from ..fingerprints import batch_digest
from ..interface import FORWARD_KEYS
from ..mesh import put_batch
from .oom import split_micro_batches
from ..losses.topk_teacher import CACHE_KEYS


def stack_batches(batches: list[dict[str, Any]], config: DistillConfig, processes: int = 1) -> dict[str, np.ndarray]:
    """The step's micro-batches stacked (grad_accum, rows, T). `config.batch_size` is global: on a multi-host mesh
    each process holds `batch_size / processes` rows of it."""
    keys = set(batches[0])
    if "input_ids" not in keys:
        raise KeyError(f"a batch needs 'input_ids' (B, T) int32; it has {sorted(keys)}.")
    stacked = {key: np.stack([np.asarray(b[key]) for b in batches])
               for key in ("input_ids", "loss_mask", *FORWARD_KEYS, *CACHE_KEYS) if key in keys}
    shape = stacked["input_ids"].shape[1:]
    expected = (config.batch_size // processes if config.batch_size else shape[0], config.seq_len or shape[1])
    if shape != expected or any(v.shape[1:3] != shape for v in stacked.values()):
        raise ValueError(f"batch arrays have shapes { {k: v.shape[1:] for k, v in stacked.items()} }; the config "
                         f"expects (batch_size, seq_len) = {expected} to lead every key.")
    for key in ("input_ids", "positions", "segment_ids"):
        if key in stacked:
            stacked[key] = stacked[key].astype(np.int32)
    return stacked


def processes(mesh) -> int:
    """Processes sharing each global batch: all of them on a mesh, each its own rows; one without a mesh."""
    return jax.process_count() if mesh is not None else 1


class BatchFeed:
    """The steps' batches from the data stream. `memory`: the loop's MemoryRetries (its plan's micro-batch
    split; it learns the data batch's rows here); `on_policy`: the OnPolicy sampler, or None."""

    def __init__(self, data: Any, config: DistillConfig, mesh: Any, memory: Any, on_policy: Any):
        self.data, self.config, self.mesh, self.memory, self.on_policy = data, config, mesh, memory, on_policy

    def next(self) -> tuple[dict[str, Any], Any, dict[str, np.ndarray], str]:
        """The next step's micro-batches on the mesh (split further after an OOM decision), the data position
        just after them (what a checkpoint taken after that step records, even when a further batch has been
        prefetched), the same batch on the host (A, B, T), before any split, and its `batch_digest`."""
        batches = [self.data.next() for _ in range(self.config.grad_accum)]
        stacked = stack_batches(batches, self.config, processes(self.mesh))
        digest = batch_digest(stacked)
        if self.on_policy is not None:
            stacked = self.on_policy.with_loss_mask(stacked)
        self.memory.data_rows = self.memory.data_rows or int(stacked["input_ids"].shape[1])
        return self.on_device(stacked), self.data.state(), stacked, digest

    def on_device(self, stacked: dict[str, np.ndarray]) -> dict[str, Any]:
        return put_batch(split_micro_batches(stacked, self.memory.plan.split), self.mesh, leading=1)

    def for_step(self, batch, host, step: int, current_student: Callable[[], Any]) -> tuple[dict[str, Any],
                                                                                            dict[str, float]]:
        """The step's batch, or the student's samples in its place when this step's on-policy draw says so
        (on_policy.py), and the fields the step record gets for it."""
        if self.on_policy is None:
            return batch, {}
        sampled, fields = self.on_policy.batch_for(host, step, current_student)
        return (batch if sampled is None else self.on_device(sampled)), fields


__all__ = ["BatchFeed", "processes", "stack_batches"]
