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

Compiling ahead, on this process's own devices (`compile_ahead`): a run's first train step and its held-out
evaluation compiled in a thread while something else runs.

    ahead = compile_ahead(None, student_like, data, control_config)   # returns at once
    ...                                                               # e.g. the distillation trains meanwhile
    ahead.wait()                                                      # then distill.run(None, control, data, ...)

On a TPU a step's first compile takes about a minute, and the chip idles through it. `compile_ahead` builds the
programs `distill.run` would build for `config` (the same `trainer.prepare_run` and `StepRunner` settings) with
abstract arguments that mirror the run's own: the float32 master weights and Adam state placed as
`StepRunner.enter_stage` places them, the frozen and teacher state as they are (committed to a device or not), the
batch as the loop stacks and puts it, the traced hyper-parameters. JAX then keeps the lowered
and compiled program in this process, and the run's first step, which asks for the same program, reuses it
instead of compiling (its step record says `compile_reused`). A program that differs anyway (another model
structure, batch shape or placement) is compiled by the run as usual: nothing but the time depends on the match.

`student` is only read (its structure, dtypes and placement), never changed, so a model of the same structure that
is training meanwhile can stand in for the one the later run trains (the pruned student for its CE control).
Compiling needs no device memory for the arguments; the thread holds the GIL only while tracing and lowering. It
is not a daemon: a process that stops meanwhile (Ctrl-C, --halt-after, an error) exits once the program being
compiled is done, with its own exit status (a daemon thread still in XLA at exit aborts the interpreter).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from . import freeze
from ..losses import term_registry as terms
from .run_config import DistillConfig
from ..interface import FORWARD_KEYS, Correspondence
from ..losses.logit_term import CPU_LOGIT_CHUNK, accelerator_logit_chunk, logit_chunk
from ..losses.representations import init_projections
from ..mesh import batch_spec, check_batch_fits, replicated
from .train_step import build_eval_step, build_train_step
from .feed import processes, stack_batches
from .step_runner import StepRunner, _shardings
from .trainer import DataStream, prepare_run, resolve_correspondence
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


# ---- compiling ahead ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AheadProgram:
    """One program to compile: its jitted `function` and the abstract `arguments` the run will call it with."""

    name: str
    function: Any  # a jitted function: `function.lower(*arguments).compile()`
    arguments: tuple
    mesh: Any


class CompileAhead:
    """Programs compiling in a thread (not a daemon: module docstring), started at construction. `wait()` joins
    it and says what it did: {"compiled_s": {name: seconds}, "error": the first failure's line or None}. A failure
    leaves the run to compile that program itself."""

    def __init__(self, programs: list[AheadProgram]):
        self.programs = programs
        self.compiled_s: dict[str, float] = {}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._compile_all, name="compile-ahead")
        self._thread.start()

    def _compile_all(self) -> None:
        for program in self.programs:
            started = time.perf_counter()
            try:
                with jax.set_mesh(program.mesh) if program.mesh is not None else contextlib.nullcontext():
                    program.function.lower(*program.arguments).compile()
            except Exception as error:  # noqa: BLE001 - the run compiles it itself then
                lines = str(error).strip().splitlines()
                self.error = f"{program.name}: {type(error).__name__}: {lines[0] if lines else ''}"[:300]
                return
            self.compiled_s[program.name] = round(time.perf_counter() - started, 3)

    def wait(self) -> dict[str, Any]:
        self._thread.join()
        return {"compiled_s": dict(self.compiled_s), "error": self.error}


def compile_ahead(teacher: Any, student: Any, data: Any, config: DistillConfig, *,
                  evaluation: bool = True) -> CompileAhead:
    """Start compiling, in a thread, the first stage's train step (and, with `evaluation` and held-out batches,
    the evaluation step) of `distill.run(teacher, <a model like student>, <data at this position>, config)`
    (module docstring). `data` is copied, not advanced."""
    data = copy.deepcopy(data)
    teacher, data, config, mesh, runner = prepare_run(teacher, student, data, config)
    stream = DataStream(data)
    host = stack_batches([stream.next() for _ in range(config.grad_accum)], config, processes(mesh))
    graph, trained, opt, frozen = _stage_state(runner, 0)
    out = None if mesh is None else (_placements(trained), _placements(opt), replicated(mesh))
    train = build_train_step(graph, runner.teacher_graph, runner.step_settings(0), runner.adam_settings, out,
                             config.compiler_options)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():  # as the loop makes them
        hyper = _mirrored({key: jnp.asarray(0.0, jnp.float32) for key in terms.hyper_keys()})
    arguments = (trained, opt, frozen, _mirrored(runner.teacher_state), _batch(host, mesh, leading=1), hyper)
    programs = [AheadProgram("train step", train, arguments, mesh)]
    held_out = stream.eval_batches(None, config.eval_batches) if evaluation and config.eval_every else []
    if held_out:
        state = nnx.merge_state(trained["student"], frozen)  # the module after `sync_student`
        evaluate = build_eval_step(graph, runner.teacher_graph, logit_chunk(config), config.compiler_options)
        batch = _batch({key: np.asarray(value) for key, value in held_out[0].items()}, mesh, leading=0)
        programs.append(AheadProgram("evaluation", evaluate, (state, _mirrored(runner.teacher_state), batch), mesh))
    return CompileAhead(programs)


def _stage_state(runner: StepRunner, index: int) -> tuple[Any, dict[str, Any], Any, Any]:
    """(graph, {"student", "proj"}, Adam's state, frozen) of stage `index` as `StepRunner.enter_stage` makes them,
    abstract: the trainable leaves as float32 masters, on the mesh as it shards them or committed to the student's
    device, Adam's state placed alike; the frozen rest mirrored as it is."""
    stage = runner.config.stages[index]
    graph, trainable, frozen = freeze.split_trainable(runner.student, stage.trainable, stage.frozen)
    mesh, params = runner.mesh, {"student": trainable, "proj": runner.projections}
    if mesh is not None:  # as enter_stage places them (step_runner._shardings)
        placements = _shardings(params, mesh)
    else:  # committed to the student's device
        device = SingleDeviceSharding(next(iter(jax.tree.leaves(trainable)[0].devices())))
        placements = jax.tree.map(lambda _: device, params)
    masters = jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, freeze.master_dtype(x.dtype),
                                                                 sharding=where), params, placements)
    opt = jax.eval_shape(runner.adam.init, masters)
    if mesh is not None:
        opt = like_parameters(opt, masters, mesh)
    else:
        opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), opt)
    return graph, masters, opt, _mirrored(frozen)


def _mirrored(tree: Any) -> Any:
    """Each array leaf as a ShapeDtypeStruct placed as the array is: its sharding where it is committed (or
    sharded), none where JAX may still place it."""
    def one(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        committed = leaf.committed or isinstance(leaf.sharding, NamedSharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding if committed else None)
    return jax.tree.map(one, tree)


def _placements(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _batch(host: dict[str, np.ndarray], mesh: Any, *, leading: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A host batch as `mesh.put_batch` places it: uncommitted without a mesh, else split over the data axes."""
    out = {}
    for key, value in host.items():
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(value).dtype)
        if mesh is None:
            out[key] = jax.ShapeDtypeStruct(value.shape, dtype)
            continue
        rows = value.shape[leading] * jax.process_count()
        shape = value.shape[:leading] + (rows,) + value.shape[leading + 1:]
        out[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, batch_spec(mesh, rows, leading)))
    return out


__all__ = ["AheadProgram", "CompileAhead", "compile_ahead", "Program", "abstract", "like_parameters",
           "batch_arguments", "train_step_program", "eval_step_program", "target_logit_chunk"]
