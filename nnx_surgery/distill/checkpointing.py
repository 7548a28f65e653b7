"""Orbax checkpoints of a distillation run: the whole student, the optimizer state, learned projections and a
JSON `meta` (step, stage, data position, learning-rate scale, guard history, fallback and OOM state, seed, the
records so far); `LoopCheckpoints` is the training loop's side of it (rollback target, resume).

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
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .fallbacks import DivergenceError


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


class LoopCheckpoints:
    """TrainingLoop's checkpoints: the rollback target (a checkpoint, else a host copy), `meta` with the run's
    bookkeeping (data position, guard, fallback and OOM state, history, evaluations, events) and resume."""

    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "stage": self.runner.stage_index, "data_state": self.data_state,
                "lr_scale": self.lr_scale, "rollbacks": self.rollbacks, "good_losses": self.good_losses,
                "seed": self.config.seed, "total_steps": self.config.total_steps,
                "fallbacks": self.fallbacks.state(), "oom": self.memory.state(),
                "history": by_step(self.resumed_history + self.history, self.step),
                "evals": by_step(self.resumed_evals + self.evals, self.step),
                "events": [e for e in self.resumed_events + self.events if e["step"] <= self.step]}

    def _mark_good(self) -> None:
        """Record the current state as the rollback target (checkpoint, else host copy)."""
        runner = self.runner
        if self.checkpointer is not None:
            if self.checkpointer.latest_step() != self.step:
                self.checkpointer.save(self.step, student=runner.full_state(), optimizer=runner.opt,
                                       projections=runner.params["proj"], meta=self._meta())
        elif self.config.guard.enabled:
            self.snapshot = {"step": self.step, "stage": runner.stage_index,
                             "student": host_snapshot(runner.full_state()), "opt": host_snapshot(runner.opt),
                             "proj": host_snapshot(runner.params["proj"])}

    def _restore_last_good(self) -> int:
        runner = self.runner
        if self.checkpointer is not None and self.checkpointer.latest_step() is not None:
            meta = self._restore_checkpoint(self.checkpointer.latest_step())
            return int(meta["step"])
        if self.snapshot is None:
            raise DivergenceError("diverged before any good state was recorded.")
        snap = self.snapshot
        runner.load(snap["stage"], from_snapshot(snap["student"]), from_snapshot(snap["opt"]),
                    from_snapshot(snap["proj"]))
        self.step = snap["step"]
        return self.step

    def _restore_checkpoint(self, step: int) -> dict[str, Any]:
        runner, checkpointer = self.runner, self.checkpointer
        meta = checkpointer.read_meta(step)
        runner.enter_stage(int(meta["stage"]), carry=False)  # templates of the right structure and placement
        student_state, opt_state, projections = checkpointer.restore(
            step, student=runner.full_state(), optimizer=runner.opt, projections=runner.params["proj"])
        runner.load(int(meta["stage"]), student_state, opt_state, projections)
        self.step = int(meta["step"])
        return meta

    def _resume(self) -> bool:
        checkpointer = self.checkpointer
        if checkpointer is None or not self.config.checkpoint.resume or checkpointer.latest_step() is None:
            return False
        meta = self._restore_newest_readable()
        self.data.restore(meta["data_state"])
        self.data_state = meta["data_state"]
        self.lr_scale, self.rollbacks = float(meta["lr_scale"]), int(meta["rollbacks"])
        self.good_losses = [float(x) for x in meta["good_losses"]]
        self.fallbacks.restore(meta.get("fallbacks"))
        self.resumed_history, self.resumed_evals = list(meta.get("history", [])), list(meta.get("evals", []))
        self.resumed_events = list(meta.get("events", []))
        self._last_eval_step = max((r["step"] for r in self.resumed_evals), default=-1)
        self._restore_memory_plan(meta.get("oom"))
        return True

    def _restore_newest_readable(self) -> dict[str, Any]:
        """Restore the newest checkpoint that reads back; an unreadable one (damaged after it was written) is
        reported and the next older one is tried."""
        steps = sorted(self.checkpointer.manager.all_steps(), reverse=True)
        for position, step in enumerate(steps):
            try:
                return self._restore_checkpoint(step)
            except Exception as error:  # noqa: BLE001 - any read failure: fall back, or re-raise on the last
                if position == len(steps) - 1:
                    raise
                self.skipped_checkpoints.append(f"step {step} in {self.checkpointer.directory} could not be read "
                                                f"({type(error).__name__}: {error}); trying step {steps[position + 1]}")
        raise AssertionError("unreachable: latest_step() named a checkpoint")

    def _latest_complete_step(self) -> int | None:
        """The newest finalised checkpoint on disk (not the manager's cached list: a write may have been cut)."""
        try:
            self.checkpointer.manager.reload()
            return self.checkpointer.latest_step()
        except Exception:  # noqa: BLE001 - only for the message; the checkpoint itself is not touched
            return None


__all__ = ["Checkpointer", "LoopCheckpoints", "abstract_like", "by_step", "HostShards", "host_snapshot", "from_snapshot"]
