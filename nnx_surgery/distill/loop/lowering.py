"""The run's own compiled steps, with abstract arguments: what `distill.run` would execute, ready to lower and
compile for devices this process does not have (a TPU slice's compile-only devices, or `cpu:N`).

    program = train_step_program(teacher, student, config, mesh, stage_index=0)
    compiled = program.function.lower(*program.arguments).compile()

`teacher` and `student` are modules whose leaves are `jax.ShapeDtypeStruct`s placed on `mesh` (e.g.
`surgery.abstract_model(config, mesh=mesh)`): nothing is allocated. The step is the trainer's: `StepRunner`'s
static settings for the stage (its loss terms, captures, logit chunking, remat), the stage's trainable split, the
Adam state `optax` would make, the batch as the loop stacks it (grad_accum, rows, T) over the data axes, and the
same output shardings. `parts` groups the arguments by what they hold (teacher, trainable student, frozen rest,
learned projections, optimizer state, batch), so a report can say where a device's bytes go.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from . import freeze
from ..losses import term_registry as terms
from .run_config import DistillConfig
from ..interface import FORWARD_KEYS, Correspondence
from ..losses.logit_term import CPU_LOGIT_CHUNK, accelerator_logit_chunk
from ..losses.representations import init_projections
from ..mesh import batch_spec, check_batch_fits, replicated
from .train_step import build_eval_step, build_train_step
from .step_runner import StepRunner
from .trainer import resolve_correspondence
from ..trimmed_vocab import in_student_vocabulary

BATCH_DTYPES = {"input_ids": jnp.int32, "loss_mask": jnp.float32, "positions": jnp.int32, "segment_ids": jnp.int32}


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of a run: its `function` (jitted) and abstract `arguments`, with `parts` naming what
    the arguments hold ({name: pytree of ShapeDtypeStruct}) and the `tokens` one call consumes."""

    name: str
    function: Callable
    arguments: tuple
    parts: dict[str, Any]
    tokens: int
    mesh: Any
    remat: str | None = None  # the student's rematerialisation in a train step (its recomputed forward costs FLOPs)

    def lower(self):
        """`function.lower(*arguments)` under the program's mesh, as the trainer runs it."""
        with jax.set_mesh(self.mesh):
            return self.function.lower(*self.arguments)


def abstract(tree: Any, mesh) -> Any:
    """Every array leaf of `tree` as a ShapeDtypeStruct on `mesh`: its own partition spec when it has a
    NamedSharding (on `mesh` or an abstract mesh of the same axes), else replicated (a concrete array made on this
    machine, such as a trimmed vocabulary's token map)."""
    def one(leaf):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(one, tree)


def like_parameters(state: Any, params: Any, mesh) -> Any:
    """The optimizer state's leaves placed as the run places them: a moment like the parameter it follows (the
    parameter at the longest tail of its key path with its shape; optax's `zeros_like` keeps the parameter's
    sharding), anything else (the step counter) replicated."""
    placed = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}

    def one(path, leaf):
        for start in range(len(path)):
            match = placed.get(jax.tree_util.keystr(path[start:]))
            if match is not None and match.shape == leaf.shape:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=match.sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated(mesh))
    return jax.tree_util.tree_map_with_path(one, state)


def target_logit_chunk(config: DistillConfig, device: Any, device_bytes: int | None) -> DistillConfig:
    """`config` with the logit chunk the run picks on `device` (step_runner.logit_chunk), from the target's memory
    per device instead of asking a device this process cannot query."""
    if config.logit_chunk:
        return config
    chunk = CPU_LOGIT_CHUNK if device.platform == "cpu" else accelerator_logit_chunk(device_bytes)
    return dataclasses.replace(config, logit_chunk=chunk)


def batch_arguments(mesh, rows: int, seq_len: int, accum: int = 1, keys=("input_ids", "loss_mask", "positions",
                                                                         "segment_ids")) -> dict[str, Any]:
    """The stacked batch the loop feeds a step: (accum, rows, T) arrays split over the data axes (accum=0: the
    evaluation's (rows, T)). A batch the data axes cannot split is a MeshError, as in a run."""
    check_batch_fits(mesh, rows)
    leading = 1 if accum else 0
    shape = ((accum,) if accum else ()) + (rows, seq_len)
    sharding = NamedSharding(mesh, batch_spec(mesh, rows, leading))
    return {key: jax.ShapeDtypeStruct(shape, BATCH_DTYPES[key], sharding=sharding) for key in keys
            if key in ("input_ids", "loss_mask") or key in FORWARD_KEYS}


def _runner(teacher, student, config: DistillConfig, mesh) -> StepRunner:
    """A StepRunner over the abstract models (its settings only: it never enters a stage here)."""
    teacher = in_student_vocabulary(teacher, student, config)
    needs_map = terms.run_needs(config, "uses_layer_map")
    corr = resolve_correspondence(config, teacher, student) if needs_map else Correspondence()
    projections = {}
    if config.feature_projection and terms.run_needs(config, "uses_projections"):
        d_t, d_s = _width(teacher), _width(student)
        projections = abstract(jax.eval_shape(lambda: init_projections(corr, d_s, d_t, config.seed)), mesh)
    runner = StepRunner(teacher, student, config, mesh, corr, projections)
    runner.teacher_state = abstract(runner.teacher_state, mesh) if runner.teacher_state is not None else None
    return runner


def _width(model) -> int:
    return int(model.config.hidden_size)


def _batch_shape(config: DistillConfig) -> tuple[int, int]:
    """The (rows, positions) of the run's batches, which a program made before any data needs in the config."""
    if config.batch_size is None or config.seq_len is None:
        raise ValueError(f"a program made before the data needs the batch shape in its config: batch_size="
                         f"{config.batch_size}, seq_len={config.seq_len}.")
    return config.batch_size, config.seq_len


def train_step_program(teacher, student, config: DistillConfig, mesh, stage_index: int, *, name: str = "",
                       device_bytes: int | None = None, keys=tuple(BATCH_DTYPES)) -> Program:
    """Stage `stage_index`'s train step as the run compiles it (module docstring), with abstract arguments."""
    config = target_logit_chunk(config, mesh.devices.flat[0], device_bytes)
    runner = _runner(teacher, student, config, mesh)
    stage = config.stages[stage_index]
    graph, trainable, frozen = freeze.split_trainable(student, stage.trainable, stage.frozen)
    params = freeze.master_weights(abstract({"student": trainable, "proj": runner.projections}, mesh))
    opt = like_parameters(jax.eval_shape(runner.adam.init, params), params, mesh)
    frozen = abstract(frozen, mesh)
    out = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt), replicated(mesh))
    function = build_train_step(graph, runner.teacher_graph, runner.step_settings(stage_index),
                                runner.adam_settings, out, config.compiler_options)
    rows, seq_len = _batch_shape(config)
    batch = batch_arguments(mesh, rows, seq_len, config.grad_accum, keys)
    hyper = {key: jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh)) for key in terms.hyper_keys()}
    arguments = (params, opt, frozen, runner.teacher_state, batch, hyper)
    parts = {"teacher": runner.teacher_state, "student": params["student"], "frozen": frozen,
             "projections": params["proj"], "optimizer": opt, "batch": batch}
    return Program(name or stage.name or f"stage {stage_index}", function, arguments, parts,
                   rows * seq_len * config.grad_accum, mesh, runner.remat)


def eval_step_program(teacher, student, config: DistillConfig, mesh, *, name: str = "evaluation",
                      device_bytes: int | None = None, keys=tuple(BATCH_DTYPES)) -> Program:
    """The held-out evaluation step of the run (`StepRunner.evaluate`) on one batch of `config.batch_size` rows."""
    config = target_logit_chunk(config, mesh.devices.flat[0], device_bytes)
    assert config.logit_chunk is not None  # target_logit_chunk sets it
    rows, seq_len = _batch_shape(config)
    runner = _runner(teacher, student, config, mesh)
    graph, state = nnx.split(student)
    state = abstract(state, mesh)
    function = build_eval_step(graph, runner.teacher_graph, config.logit_chunk, config.compiler_options)
    batch = batch_arguments(mesh, rows, seq_len, 0, keys)
    arguments = (state, runner.teacher_state, batch)
    parts = {"teacher": runner.teacher_state, "student": state, "batch": batch}
    return Program(name, function, arguments, parts, rows * seq_len, mesh)


__all__ = ["Program", "abstract", "like_parameters", "batch_arguments", "train_step_program", "eval_step_program",
           "target_logit_chunk"]
