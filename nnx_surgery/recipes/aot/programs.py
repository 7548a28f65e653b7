"""The programs a compress run executes on its devices, built from the run's settings with abstract models (no
weights): each a `distill.loop.lowering.Program` ready to lower and compile for an `--aot` target.

    run = aot_run(config)                       # the run's settings; the teacher's config.json alone
    for entry in run_programs(run, target):     # in the order the run meets them
        program = entry.build()                 # abstract models on the target's mesh, the step with its args

The list follows `compress.main`: the teacher correction's step (--teacher-correction), the teacher's calibration
forward (activation importance, `surgery.planning.importance`), the MLP refit of a cut that narrows the MLP
(--refit-rows, `surgery.refit_mlp`), stage A's step (staged compression), after the final cut the K/V warm-up's and
each main stage's step, the held-out evaluation step, and the control's step. The students' shapes are the plan's
(its sizes; which channels are kept changes no shape).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery import surgery
from nnx_surgery.distill.loop import lowering as abstract_step
from nnx_surgery.distill.mesh import MeshError, parse_mesh_spec
from nnx_surgery.recipes.compress import phase_configs, run_settings, shape_search, student_refit
from nnx_surgery.recipes.aot import released
from nnx_surgery.recipes.compress import resolution
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.recipes.aot.targets import Target, target_mesh
from nnx_surgery.refusals import RecipeError
from nnx_surgery.recipes.compress.run_settings import RunSettings
from nnx_surgery.surgery.planning import importance
from nnx_surgery.surgery.pruning import mlp_refit


@dataclasses.dataclass(frozen=True)
class Entry:
    """A program of the run, not built yet: `build()` makes its abstract models and step (cheap: no compile).
    `train` tells a train step (the search's memory-critical programs) from a forward."""

    name: str
    phase: str
    build: Callable[[], abstract_step.Program]
    train: bool = True


def aot_run(config: RecipeConfig) -> RunSettings:
    """The run's settings as `run_settings.for_config` makes them, with the teacher's config alone (released.py):
    nothing downloaded but a config.json, nothing trained (the tiny preset's teacher) or imported. The GGUF export
    and the data run no program on the devices, so they are not looked at; the output folder is checked as for
    --dry-run (only the report is written there)."""
    config = resolution.replaced(config, run={"gguf": None})
    output = run_settings.output_settings(resolution.replaced(config, run={"dry_run": True}))  # a folder in use is fine
    source, where, teacher_config = released.teacher_config(config)
    teacher = run_settings.Teacher(source, where, teacher_config, config.training.compute_dtype)
    choice = shape_search.student_choice(config, teacher_config, None)
    bare = RunSettings(config, output, teacher, None, None, None, None)  # type: ignore[arg-type]
    return run_settings.for_student(bare, choice.spec, choice)


def mesh_sizes(run: RunSettings, target: Target) -> dict[str, int]:
    """--mesh's axes, or fsdp over every device of the target (what a run on a slice would be given)."""
    if not run.config.training.mesh:
        return {"fsdp": len(target.devices)}
    try:
        return parse_mesh_spec(run.config.training.mesh)
    except MeshError as error:
        raise RecipeError(f"--mesh {run.config.training.mesh!r}: {error}") from None


def student_configs(run: RunSettings) -> tuple[surgery.ModelConfig | None, surgery.ModelConfig, dict, dict | None]:
    """(stage A's student config or None, the final student's, the final plan's lineage, stage A's plan): sizes
    from the specs, layers spread evenly over the teacher's depth."""
    teacher, spec = run.teacher.config, run.student.spec
    first = run.student.stage_a_spec
    kept = _spread(teacher.num_hidden_layers, spec.num_layers)
    stage_a, plan_a = None, None
    if first is not None:
        stage_a = first.config_for(teacher, kept)
        plan_a = {"kept_layers": kept, "kept_hidden": list(range(teacher.hidden_size))}
    final = spec.config_for(teacher, kept)
    pieces = spec.vocab_size_for(teacher)
    lineage = {"kept_layers": kept, "kept_hidden": list(range(spec.hidden_size)),
               "kept_vocab": list(range(pieces)) if pieces is not None else None}
    if pieces is not None:
        final = final.replace(vocab_size=pieces)
    return stage_a, final, lineage, plan_a


def _spread(depth: int, keep: int) -> list[int]:
    return sorted({int(round(i)) for i in np.linspace(0, depth - 1, keep)}) if keep < depth else list(range(depth))


def run_programs(run: RunSettings, target: Target, device_bytes: int | None = None) -> list[Entry]:
    """Every program the run executes on the devices, in order (module docstring)."""
    config, stages = run.config, run.stages
    mesh = target_mesh(target, mesh_sizes(run, target))
    memory = device_bytes or target.memory_per_device
    stage_a_config, final, lineage, plan_a = student_configs(run)
    teacher_dtype = jnp.dtype(run.teacher.dtype)

    def model(config, dtype=jnp.float32):
        return surgery.abstract_model(config, dtype=dtype, mesh=mesh)

    def step(phase, stage_list, index, teacher_config, student_config, plan, name):
        def build():
            phase_config = run.phase_config(phase, stage_list, plan)
            teacher = model(teacher_config, teacher_dtype) if teacher_config is not None else None
            return abstract_step.train_step_program(teacher, model(student_config), phase_config, mesh, index,
                                                    name=name, device_bytes=memory)
        return Entry(name, phase, build)

    entries = []
    if stages.teacher_correction is not None:
        entries.append(step("teacher_correction", [stages.teacher_correction], 0, None, run.teacher.config, None,
                            "teacher correction"))
    if config.surgery.calibration_samples:
        entries.append(Entry("calibration forward", "surgery",
                             lambda: calibration_program(model(run.teacher.config, teacher_dtype), mesh,
                                                         config.data.seq_len), train=False))
    refit_a, refit_final = _refit_entries(run, model, mesh, stage_a_config, final, teacher_dtype)
    entries += refit_a
    if stages.stage_a is not None:
        entries.append(step("stage_a", [stages.stage_a], 0, run.teacher.config, stage_a_config, plan_a,
                            stages.stage_a.name or "stage A"))
    entries += refit_final
    for index, stage in enumerate(stages.stage_b):
        entries.append(step("stage_b", stages.stage_b, index, run.teacher.config, final, lineage,
                            stage.name or f"stage B{index + 1}"))
    entries.append(Entry("evaluation", "stage_b", lambda: abstract_step.eval_step_program(
        model(run.teacher.config, teacher_dtype), model(final),
        run.phase_config("stage_b", stages.stage_b, lineage), mesh, device_bytes=memory), train=False))
    if config.student.control != "none":
        control = phase_configs.control_stage(config, config.training.steps)
        entries.append(step("control", [control], 0, None, final, None, f"control ({config.student.control})"))
    return _distinct(entries)


def _refit_entries(run: RunSettings, model: Callable, mesh, stage_a_config, final,
                   teacher_dtype) -> tuple[list[Entry], list[Entry]]:
    """(stage A's refit, the final cut's), each an empty list unless that cut's MLP is narrower than its source's:
    stage A's from the teacher, the final cut's from the stage-A student (the teacher resident beside it) or from
    the teacher."""
    rows, seq_len, teacher = run.config.surgery.refit_rows, run.config.data.seq_len, run.teacher.config

    def entries(name, source, source_dtype, student, beside) -> list[Entry]:
        def build():
            return refit_program(model(source, source_dtype), model(student), mesh, rows, seq_len,
                                 batch=student_refit.batch_rows(seq_len), name=name,
                                 resident=None if beside is None else model(beside, teacher_dtype))
        narrowed = rows and student.intermediate_size < source.intermediate_size
        return [Entry(name, "surgery", build, train=False)] if narrowed else []

    if stage_a_config is None:
        return [], entries("MLP refit", teacher, teacher_dtype, final, None)
    return (entries("MLP refit (stage A)", teacher, teacher_dtype, stage_a_config, None),
            entries("MLP refit", stage_a_config, jnp.float32, final, teacher))


def _distinct(entries: list[Entry]) -> list[Entry]:
    return list({entry.name: entry for entry in entries}.values())


def calibration_program(teacher, mesh, seq_len: int, rows: int = 8) -> abstract_step.Program:
    """The activation-importance forward (`surgery.planning.importance`) on one calibration batch of `rows` x `seq_len`
    (the planner's batch), on the teacher as the run places it."""
    graph, state = nnx.split(teacher)
    state = abstract_step.abstract(state, mesh)
    statistics = importance._batch_stats.__wrapped__  # type: ignore[attr-defined]  # the jitted function's body, over graph + state here

    @jax.jit
    def forward(state, ids):
        return statistics(nnx.merge(graph, state), ids)

    ids = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32,
                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return abstract_step.Program("calibration forward", forward, (state, ids), {"teacher": state, "batch": ids},
                                 rows * seq_len, mesh)


def refit_program(source, student, mesh, rows: int, seq_len: int, batch: int, name: str = "MLP refit",
                  resident=None) -> abstract_step.Program:
    """`surgery.refit_mlp`'s products for the student's last layer on one batch of `batch` x `seq_len` (the run's
    batch: `student_refit.batch_rows`), as the run holds them: the source model and the student on the devices (and
    `resident`, the teacher beside a stage-A source), every one of the `rows` rows' layer inputs kept between
    layers (sharded as the student's jitted `layer_inputs` returns them), and the source MLP's weights at the
    student's hidden width."""
    (_, source_state), (graph, state) = nnx.split(source), nnx.split(student)
    source_state, state = abstract_step.abstract(source_state, mesh), abstract_step.abstract(state, mesh)
    ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32,
                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def layer_inputs(state, ids):
        return nnx.merge(graph, state).layer_inputs(ids)
    lowered = jax.jit(layer_inputs).lower(state, ids)
    x, positions, masks = jax.tree.map(lambda out, sharding: jax.ShapeDtypeStruct(out.shape, out.dtype,
                                                                                 sharding=sharding),
                                       lowered.out_info, lowered.compile().output_shardings)
    held = jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=x.sharding)  # the rows' inputs, in batches
    index = student.config.num_hidden_layers - 1
    source_mlp, width, neurons = source.layers[-1].mlp, student.config.hidden_size, source.config.intermediate_size

    def sliced(param, shape):  # the source's weight at the student's width, placed like the weight
        return jax.ShapeDtypeStruct(shape, param.get_value().dtype,
                                    sharding=abstract_step.abstract(param.get_value(), mesh).sharding)
    full = (sliced(source_mlp.gate_proj.weight, (neurons, width)), sliced(source_mlp.up_proj.weight, (neurons, width)),
            sliced(source_mlp.down_proj.weight, (width, neurons)))
    products = mlp_refit._layer_products.__wrapped__  # type: ignore[attr-defined]  # the jitted function's body
    extra = () if resident is None else (abstract_step.abstract(nnx.split(resident)[1], mesh),)

    @functools.partial(jax.jit, keep_unused=True)  # the models and held inputs are resident, not read: still counted
    def refit(source_state, state, held, x, positions, mask, gate, up, down, *extra):
        return products(nnx.merge(graph, state).layers[index], x, positions, mask, gate, up, down)

    arguments = (source_state, state, held, x, positions, masks[student.layers[index].attention_type], *full, *extra)
    # the models the cut learns from count as its teacher: the source, and the teacher beside a stage-A source
    parts = {"teacher": (source_state, *extra), "student": state, "batch": (held, x)}
    return abstract_step.Program(name, refit, arguments, parts, batch * seq_len, mesh)


__all__ = ["Entry", "aot_run", "run_programs", "student_configs", "mesh_sizes", "calibration_program",
           "refit_program"]
