"""Orbax checkpoints of a distillation run: the whole student, the optimizer state, learned projections and a
JSON `meta` (step, stage, data position, learning-rate scale, guard history, fallback and OOM state, seed, the
records so far); `RunCheckpoints` is the training loop's collaborator for them (rollback target, resume).

Restores go against ShapeDtypeStruct targets carrying the shardings of the arrays currently in memory, so a run
resumes on the mesh it is started with, whichever mesh wrote the checkpoint. The optimizer
state's structure depends on the stage's trainable set, so `meta` is read first and the caller builds the stage
before restoring the rest. Saves are synchronous: the step donates its input buffers right after.

Multi-host: every process calls save, restore and `wait_until_finished` together (orbax writes each process's
shards into the one shared directory), and a checkpoint written by N processes restores in any number on any mesh.
The in-memory rollback copy (no checkpoint directory) keeps each process's own shards on its host (HostShards).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from .fallbacks import DivergenceError
from ..interruption import remove_unfinished_saves


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStruct leaves with the current arrays' shapes, dtypes and shardings."""
    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(spec, tree)


class HostShards:
    """A host copy of the part of a jax.Array this process holds: one numpy block per distinct shard (replicas
    are stored once), and the sharding to put it back with. What the in-memory rollback snapshot keeps of an
    array that spans processes, where `device_get` of the whole array is impossible and would hold the model
    once per process."""

    def __init__(self, array: jax.Array):
        self.shape, self.dtype, self.sharding = array.shape, array.dtype, array.sharding
        blocks: dict[str, np.ndarray] = {}
        for shard in array.addressable_shards:
            key = repr(shard.index)
            if key not in blocks:
                blocks[key] = np.asarray(shard.data)
        self.blocks = blocks

    def to_device(self) -> jax.Array:
        locals_ = [jax.device_put(self.blocks[repr(index)], device)
                   for device, index in self.sharding.addressable_devices_indices_map(self.shape).items()]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, locals_)


def host_snapshot(tree: Any) -> Any:
    """`tree` copied to the host: whole arrays when this process holds them all (one host), else each process's
    own shards (HostShards)."""
    def copy(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return HostShards(x)
        return jax.device_get(x)
    return jax.tree.map(copy, tree)


def from_snapshot(tree: Any) -> Any:
    """A host_snapshot back to values `StepRunner.load` takes (HostShards become global arrays again)."""
    return jax.tree.map(lambda x: x.to_device() if isinstance(x, HostShards) else x, tree,
                        is_leaf=lambda x: isinstance(x, HostShards))


class Checkpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, *, student: Any, optimizer: Any, projections: dict, meta: dict[str, Any]) -> None:
        items = {"student": ocp.args.StandardSave(student), "optimizer": ocp.args.StandardSave(optimizer),
                 "meta": ocp.args.JsonSave({**meta, "has_projections": bool(projections)})}
        if projections:
            items["projections"] = ocp.args.StandardSave(projections)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def restore(self, step: int, *, student: Any, optimizer: Any, projections: dict) -> tuple[Any, Any, dict]:
        """Arrays for the given templates (current in-memory values define shapes, dtypes and shardings)."""
        items = {"student": ocp.args.StandardRestore(abstract_like(student)),
                 "optimizer": ocp.args.StandardRestore(abstract_like(optimizer))}
        if projections:
            items["projections"] = ocp.args.StandardRestore(abstract_like(projections))
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["student"], restored["optimizer"], (restored["projections"] if projections else {})

    def close(self) -> None:
        self.manager.close()


def by_step(records: list[dict[str, Any]], last_step: int) -> list[dict[str, Any]]:
    """One record per step up to `last_step` (the latest written wins: a step redone after a rollback)."""
    return sorted({r["step"]: r for r in records if r["step"] <= last_step}.values(), key=lambda r: r["step"])


class RunCheckpoints:
    """A run's checkpoints, collaborator of the training loop: the rollback target (the latest checkpoint, else,
    with the guard on and no directory, a host copy of the last good state) and resume.

    State: `checkpointer` (None without a directory), `snapshot` (the host copy), `stale_saves` (unfinished writes
    of an earlier run, removed on start) and `skipped` (unreadable checkpoints passed over on resume). The loop
    passes what a checkpoint records besides the model state (`meta`, built only when one is written)."""

    def __init__(self, config: Any, runner: Any):
        ckpt = config.checkpoint
        self.runner = runner
        self.resume_enabled = ckpt.resume
        self.keeps_snapshot = config.guard.enabled
        self.stale_saves = remove_unfinished_saves(ckpt.directory) if ckpt.directory else []
        self.checkpointer = Checkpointer(ckpt.directory, ckpt.keep) if ckpt.directory else None
        self.snapshot: dict[str, Any] | None = None
        self.skipped: list[str] = []

    @property
    def directory(self) -> str | None:
        return self.checkpointer.directory if self.checkpointer is not None else None

    def _required_checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise ValueError("no checkpoint directory: set checkpoint.directory to restore a checkpoint.")
        return self.checkpointer

    def mark_good(self, step: int, meta: Callable[[], dict[str, Any]]) -> None:
        """Record the state at `step` as the rollback target (checkpoint with `meta()`, else host copy)."""
        runner = self.runner
        if self.checkpointer is not None:
            if self.checkpointer.latest_step() != step:
                self.checkpointer.save(step, student=runner.full_state(), optimizer=runner.opt,
                                       projections=runner.params["proj"], meta=meta())
        elif self.keeps_snapshot:
            self.snapshot = {"step": step, "stage": runner.stage_index,
                             "student": host_snapshot(runner.full_state()), "opt": host_snapshot(runner.opt),
                             "proj": host_snapshot(runner.params["proj"])}

    def restore_last_good(self) -> int:
        """Put the rollback target back into the runner; returns its step."""
        latest_step = self.checkpointer.latest_step() if self.checkpointer is not None else None
        if latest_step is not None:
            return int(self.restore(latest_step)["step"])
        if self.snapshot is None:
            raise DivergenceError("diverged before any good state was recorded.")
        snap = self.snapshot
        self.runner.load(snap["stage"], from_snapshot(snap["student"]), from_snapshot(snap["opt"]),
                         from_snapshot(snap["proj"]))
        return snap["step"]

    def restore(self, step: int) -> dict[str, Any]:
        """Load checkpoint `step` into the runner; returns its `meta`."""
        runner, checkpointer = self.runner, self._required_checkpointer()
        meta = checkpointer.read_meta(step)
        runner.enter_stage(int(meta["stage"]), carry=False)  # templates of the right structure and placement
        student_state, opt_state, projections = checkpointer.restore(
            step, student=runner.full_state(), optimizer=runner.opt, projections=runner.params["proj"])
        runner.load(int(meta["stage"]), student_state, opt_state, projections)
        return meta

    def resume(self) -> dict[str, Any] | None:
        """The `meta` of the checkpoint a run continues from, its state loaded; None when there is none (no
        directory, resume off, nothing written yet)."""
        checkpointer = self.checkpointer
        if checkpointer is None or not self.resume_enabled or checkpointer.latest_step() is None:
            return None
        return self._restore_newest_readable()

    def _restore_newest_readable(self) -> dict[str, Any]:
        """Restore the newest checkpoint that reads back; an unreadable one (damaged after it was written) is
        reported and the next older one is tried."""
        checkpointer = self._required_checkpointer()
        steps = sorted(checkpointer.manager.all_steps(), reverse=True)
        for position, step in enumerate(steps):
            try:
                return self.restore(step)
            except Exception as error:  # noqa: BLE001 - any read failure: fall back, or re-raise on the last
                if position == len(steps) - 1:
                    raise
                self.skipped.append(f"step {step} in {checkpointer.directory} could not be read "
                                    f"({type(error).__name__}: {error}); trying step {steps[position + 1]}")
        raise AssertionError("unreachable: latest_step() named a checkpoint")

    def latest_complete_step(self) -> int | None:
        """The newest finalised checkpoint on disk (not the manager's cached list: a write may have been cut)."""
        if self.checkpointer is None:
            return None
        try:
            self.checkpointer.manager.reload()
            return self.checkpointer.latest_step()
        except Exception:  # noqa: BLE001 - only for the message; the checkpoint itself is not touched
            return None

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


__all__ = ["Checkpointer", "RunCheckpoints", "abstract_like", "by_step", "HostShards", "host_snapshot", "from_snapshot"]
