"""The programs a compress run executes on its devices, built from the run's settings with abstract models (no
weights): each a `distill.loop.lowering.Program` ready to lower and compile for an `--aot` target.

    run = aot_run(config)                       # the run's settings; the teacher's config.json alone
    for entry in run_programs(run, target):     # in the order the run meets them
        program = entry.build()                 # abstract models on the target's mesh, the step with its args

The list follows `compress.main`: the teacher correction's step (--teacher-correction), the teacher's calibration
forward (activation importance, `surgery.planning.importance`), stage A's step (staged compression), after the final cut
the K/V warm-up's and each main stage's step, the held-out evaluation step, and the control's step. The students'
shapes are the plan's (its sizes; which channels are kept changes no shape).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery import surgery
from nnx_surgery.distill.loop import lowering as abstract_step
from nnx_surgery.distill.mesh import MeshError, parse_mesh_spec
from nnx_surgery.recipes import phase_configs, released, run_settings, shape_search
from nnx_surgery.recipes.config import resolution
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.recipes.aot_targets import Target, target_mesh
from nnx_surgery.recipes.refusals import RecipeError
from nnx_surgery.recipes.run_settings import RunSettings


@dataclasses.dataclass(frozen=True)
class Entry:
    """A program of the run, not built yet: `build()` makes its abstract models and step (cheap: no compile).
    `train` tells a train step (the search's memory-critical programs) from a forward."""

    name: str
    phase: str
    build: Callable[[], abstract_step.Program]
    train: bool = True


def aot_run(config: RecipeConfig) -> RunSettings:
    """The run's settings as `run_settings.resolve` makes them, with the teacher's config alone (released.py):
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
    if stages.stage_a is not None:
        entries.append(step("stage_a", [stages.stage_a], 0, run.teacher.config, stage_a_config, plan_a,
                            stages.stage_a.name or "stage A"))
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


def _distinct(entries: list[Entry]) -> list[Entry]:
    return list({entry.name: entry for entry in entries}.values())


def calibration_program(teacher, mesh, seq_len: int, rows: int = 8) -> abstract_step.Program:
    """The activation-importance forward (`surgery.planning.importance`) on one calibration batch of `rows` x `seq_len`
    (the planner's batch), on the teacher as the run places it."""
    from nnx_surgery.surgery.planning import importance
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


__all__ = ["Entry", "aot_run", "run_programs", "student_configs", "mesh_sizes", "calibration_program"]
