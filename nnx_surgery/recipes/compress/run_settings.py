"""The run's settings, resolved once before anything trains: the configuration (`compress.resolution.resolve`) and
every value derived from it and the teacher, in one frozen record that the phases read and nothing writes.

    config = resolution.resolve(argv)   # defaults < preset < schedule < --config < flags < --set; no teacher read
    run = run_settings.for_config(config)  # + the output folder, the teacher (its config.json read once), the data,
                                        #   the evaluation, the student (and stage A's shape), its stages

A shape search (`--student params=...`) picks the student while the run goes; `for_student(run, winner)` is then
the same settings for the winner (a new record: its stage-A shape, KV merge and stages).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery import model_inputs
from nnx_surgery.recipes.inputs import tiny_teacher
from nnx_surgery.recipes.compress import phase_configs, shape_search
from nnx_surgery.recipes.config.layering import freeze
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.recipes.inputs.corpus import DataSettings
from nnx_surgery.refusals import RecipeError
from nnx_surgery.evaluation.final_eval import EvalSettings
from nnx_surgery.export import gguf_export

PHASES = ("teacher_correction", "stage_a", "stage_b", "control")
STDLIB_PRESETS = ("gemma3-270m", "gemma3-270m-tpu")  # the real 270M on the standard library's source


@dataclasses.dataclass(frozen=True)
class Output:
    """The run folder (checked, not yet prepared), whether an earlier run is there, and --halt-after's step per
    phase."""

    folder: str
    started: bool
    halt_steps: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Teacher:
    """`source` is what plans and the model card name (--teacher, or the tiny preset's cached folder), `folder` a
    local HF folder, `config` its config.json as read, `dtype` the precision it loads and teaches in."""

    source: str
    folder: str
    config: surgery.ModelConfig
    dtype: str


@dataclasses.dataclass(frozen=True)
class Student:
    """The student: the --student choice (a shape, or a budget and the shapes to search), its spec (the search's
    uniform guess until the search picks the winner), stage A's spec with --compression staged (depth and MLP
    width cut, the rest the teacher's), and whether its KV heads are merged (then a K/V warm-up runs first)."""

    choice: shape_search.StudentChoice
    spec: surgery.StudentSpec
    stage_a_spec: surgery.StudentSpec | None
    kv_merged: bool


@dataclasses.dataclass(frozen=True)
class Stages:
    """Every phase's stages, built for the student's depth (phase_configs.py): stage A (staged compression), after the
    final cut a K/V warm-up (merged KV heads) then the main stages, and the teacher correction's."""

    teacher_correction: distill.Stage | None
    stage_a: distill.Stage | None
    kv_warmup: distill.Stage | None
    main: tuple[distill.Stage, ...]

    @property
    def stage_b(self) -> tuple[distill.Stage, ...]:
        return ((self.kv_warmup,) if self.kv_warmup else ()) + self.main


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One run's settings: its configuration and what follows from it and the teacher (module docstring)."""

    config: RecipeConfig
    output: Output
    teacher: Teacher
    data: DataSettings
    evaluation: EvalSettings
    student: Student
    stages: Stages

    @property
    def folder(self) -> str:
        return self.output.folder

    def phase_config(self, phase: str, stages, plan: Any = None, data: Any = None) -> distill.DistillConfig:
        """`phase`'s DistillConfig (phase_configs.phase_config) in the run folder, with its --halt-after step."""
        return phase_configs.phase_config(self.config, phase, stages, plan, self.folder, data,
                                   halt_after=self.output.halt_steps.get(phase))


def for_config(config: RecipeConfig) -> RunSettings:
    """The run's settings: the output folder checked, the teacher found (the tiny preset's trained once and
    cached; a Hub id downloaded; a GGUF imported), its config read, the student chosen and checked against it, the
    stages built. Refusals are RecipeError / SpecError lines, before any weights load."""
    output = output_settings(config)
    teacher, corpus, description = locate_teacher(config)
    limit = model_inputs.position_limit(teacher.folder, teacher.config)
    check_new_tokens(config, teacher, limit.get("max_positions"))
    choice = shape_search.student_choice(config, teacher.config, teacher.folder)
    if config.run.gguf:  # before hours of training: only Gemma students export (export.export_gguf says why)
        gguf_export.check_exportable(teacher.config, teacher.folder)
    data = DataSettings(files=config.data.files, corpus=corpus, description=description,
                        teacher_folder=teacher.folder,
                        batch_size=config.data.batch_size, seq_len=config.data.seq_len, seed=config.run.seed,
                        restart_rows=config.data.restart_rows, general_mix=config.data.general_mix,
                        general_source=config.data.general_source,
                        position_limit=freeze(limit))
    evaluation = EvalSettings.of(config, teacher.folder, description)
    bare = RunSettings(config, output, teacher, data, evaluation, None, None)  # type: ignore[arg-type]
    return for_student(bare, choice.spec, choice)


def check_new_tokens(config: RecipeConfig, teacher: Teacher, positions: int | None) -> None:
    """--new-tokens (the suite's greedy continuations) must leave room for a prompt in the teacher's positions."""
    if config.evaluation.prompts and positions and config.evaluation.new_tokens >= positions:
        raise RecipeError(f"--new-tokens {config.evaluation.new_tokens}: the teacher ({teacher.source}) has "
                              f"{positions:,} positions, which must hold the prompt and the new tokens; give at "
                              f"most {positions // 2:,}, or --eval-prompts 0 for no generations.")


def output_settings(config: RecipeConfig) -> Output:
    """The run folder, refused when missing, busy (without --resume or --overwrite) or not a folder, and
    --halt-after parsed."""
    output = config.run.output
    if not output:
        raise RecipeError("--output is required: the run folder (student, plans, results, checkpoints).")
    if jax.process_count() > 1 and not config.training.mesh:
        raise RecipeError(f"a multi-host run ({jax.process_count()} processes) needs --mesh over all "
                              f"{jax.device_count()} devices, e.g. --mesh fsdp={jax.device_count()}.")
    run = config.run
    folder, started = model_inputs.output_folder(output, resume=run.resume, overwrite=run.overwrite,
                                           dry_run=run.dry_run)
    halt_steps = {}
    if config.run.halt_after:
        phase, _, step = config.run.halt_after.partition(":")
        if phase not in PHASES or not step.isdigit():
            raise RecipeError(f"--halt-after {config.run.halt_after!r}: use PHASE:STEP with PHASE in {PHASES}.")
        halt_steps[phase] = int(step)
    return Output(folder, started, freeze(halt_steps))


def locate_teacher(config: RecipeConfig) -> tuple[Teacher, tuple[str, ...] | None, str]:
    """(the teacher, the preset's corpus files or None, what the training text is). The tiny preset makes both
    offline (the teacher trained once, cached in --cache-dir); the gemma3-270m presets read the standard library's
    source (its teacher, the real GGUF, is imported once and cached)."""
    source, corpus = config.teacher.model, None
    if config.run.preset == "tiny" and config.teacher.model is None:
        source, files = tiny_teacher.prepare_for(config)
        corpus = tuple(files)
        description = (f"{len(corpus)} files of the Python standard library's source, byte-level tokens "
                       "(offline tiny preset)")
    elif config.data.files is None and config.run.preset in STDLIB_PRESETS:
        corpus = tuple(tiny_teacher.corpus_files(config.data.corpus_bytes, config.run.seed))
        description = f"{len(corpus)} modules of the Python standard library's source (held-out modules)"
    else:
        description = config.data.files or ""
    if source is None:
        raise RecipeError("--teacher is required (a folder, a Hub repo id or a .gguf file); only the tiny preset "
                          "makes its own.")
    folder = model_inputs.teacher_folder(source, config.teacher.revision)
    teacher = Teacher(source, folder, surgery.ModelConfig.from_file(folder), config.training.compute_dtype)
    return teacher, corpus, description


def for_student(run: RunSettings, spec: surgery.StudentSpec,
                choice: shape_search.StudentChoice | None = None) -> RunSettings:
    """`run` with `spec` as its student: stage A's spec, whether its KV heads merge, and the stages for its depth."""
    teacher = run.teacher.config
    stage_a_spec = None
    if run.config.surgery.compression == "staged":  # depth and MLP width of the final student, the rest the teacher's
        stage_a_spec = surgery.StudentSpec(spec.num_layers, teacher.hidden_size, spec.intermediate_size,
                                           teacher.num_attention_heads, teacher.num_key_value_heads)
    merged = spec.num_key_value_heads != teacher.num_key_value_heads and spec.check_against(teacher) == "merge"
    student = Student(choice or run.student.choice, spec, stage_a_spec, merged)
    return dataclasses.replace(run, student=student, stages=build_stages(run.config, student))


def build_stages(config: RecipeConfig, student: Student) -> Stages:
    """Every phase's stages for `student` (phase_configs.py), checked with the distill section. After the final cut the
    main stages share --steps with stage A and the K/V warm-up (--kv-warmup of --steps, when KV heads merge)."""
    try:
        stage_a = phase_configs.stage_a_stage(config) if student.stage_a_spec is not None else None
        steps_b = config.training.steps - (stage_a.steps if stage_a else 0)
        share = config.surgery.kv_warmup
        warmup = max(1, round(config.training.steps * share)) if share > 0 and student.kv_merged else 0
        main = tuple(phase_configs.main_stages(config, student.spec.num_layers, max(1, steps_b - warmup)))
        dataclasses.replace(config.distill, stages=main)  # checked with the distill section
        correction = phase_configs.teacher_correction_stage(config) if config.teacher.correction else None
        return Stages(teacher_correction=correction, stage_a=stage_a,
                      kv_warmup=phase_configs.kv_warmup(config, warmup) if warmup else None, main=main)
    except RecipeError:
        raise
    except (ValueError, TypeError) as error:
        raise RecipeError(f"distill settings: {error}") from None


__all__ = ["RunSettings", "Output", "Teacher", "Student", "Stages", "for_config", "output_settings", "locate_teacher",
           "for_student", "build_stages", "PHASES"]
