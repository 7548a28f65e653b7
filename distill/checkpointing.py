"""Orbax checkpoints of a distillation run: the whole student, the optimizer state, learned projections and a
JSON `meta` (step, stage, data position, learning-rate scale, guard history, seed).

Restores go against ShapeDtypeStruct targets carrying the shardings of the arrays currently in memory, so a run
resumes on the mesh it is started with, whichever mesh wrote the checkpoint. The optimizer
state's structure depends on the stage's trainable set, so `meta` is read first and the caller builds the stage
before restoring the rest. Saves are synchronous: the step donates its input buffers right after.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStruct leaves with the current arrays' shapes, dtypes and shardings."""
    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(spec, tree)


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


__all__ = ["Checkpointer", "abstract_like"]
