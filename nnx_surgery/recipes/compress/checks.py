"""Checks across settings, before any model is loaded or anything written: what one field's declaration cannot
say alone (warm-up within the run, a schedule with written-out stages, the stages the settings make, the data
named, the output folder against the inputs, the Hub token). `check_devices` is the one that touches devices, so
a multi-host run calls it after jax.distributed has started."""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

from nnx_surgery import distill, surgery
from nnx_surgery.distill.inputs import packaged_prose, sources
from nnx_surgery.distill.mesh import MeshError, make_mesh, parse_mesh_spec
from nnx_surgery.export import gguf_export
from nnx_surgery.export.hub import check_push_access
from nnx_surgery.paths import guard_folder, input_paths
from nnx_surgery.recipes.compress import phase_configs, teacher_caching
from nnx_surgery.recipes.config import layering
from nnx_surgery.surgery.plans.search_space import parse_budget
from nnx_surgery.recipes.config.sections import PACKAGED_SOURCES, RecipeConfig
from nnx_surgery.refusals import RecipeError, wrong_kind


@contextlib.contextmanager
def named_by_flags() -> Iterator[None]:
    """DistillConfig's refusals (ValueError, TypeError, ArithmeticError) as a RecipeError naming the flags."""
    try:
        yield
    except RecipeError:
        raise
    except (ValueError, TypeError, ArithmeticError) as error:
        raise RecipeError(f"distill settings: {flag_names(str(error))}") from None


def flag_names(text: str) -> str:
    """DistillConfig's field names in an error (`top_k=...`) as the flags that set them (`--top-k ...`)."""
    flags = {item.path[-1]: item.flag for item in layering.every_field() if item.flag and item.path[0] == "distill"}
    return re.sub(r"\b(\w+)=", lambda m: f"{flags[m.group(1)]} " if m.group(1) in flags else m.group(0), text)


def check_settings(config: RecipeConfig) -> None:
    training = config.training
    if training.warmup_steps is not None and not 0 <= training.warmup_steps <= training.steps:
        raise RecipeError(f"--warmup-steps {training.warmup_steps}: give from 0 to --steps {training.steps} warm-up "
                          "steps (a longer warm-up never reaches the peak learning rate).")
    if config.run.gguf is not None:
        try:
            gguf_export.resolve_export_dtype(config.run.gguf)
        except ValueError as err:
            raise RecipeError(f"--gguf {config.run.gguf}: {err}") from None
    if training.schedule != "none" and training.stages:
        raise RecipeError(f"--schedule {training.schedule} and training.stages in the config both set the "
                          "distillation stages; keep one.")
    if training.schedule == "progressive" and training.trainable:
        raise RecipeError("--trainable cannot be combined with --schedule progressive, which sets what trains in "
                          "each stage; use --frozen for patterns to keep frozen throughout.")
    with named_by_flags():  # the stages are built once the student's depth is known (run_settings)
        phase_configs.check_stage_settings(config)
    teacher_caching.check_cache_settings(config)
    _check_aot_companions(config)
    _check_budget(config.student.shape)
    _check_data(config.data.files)
    _check_general_source(config)
    _check_output(config)


def _check_aot_companions(config: RecipeConfig) -> None:
    """--aot's companions not without --aot (their ranges are checked with their declarations)."""
    if config.aot.target is None:
        for flag, value in (("--aot-tokens", config.aot.tokens), ("--aot-mfu", config.aot.mfu),
                            ("--aot-search", config.aot.search)):
            if value:
                raise RecipeError(f"{flag} goes with --aot TARGET (the compile it reports on).")


def check_devices(config: RecipeConfig) -> None:
    """--mesh's axes fit the devices (a dry run or --aot sizes another machine's: only its syntax)."""
    mesh = config.training.mesh
    if not mesh:
        return
    try:
        if config.run.dry_run or config.aot.target:
            parse_mesh_spec(mesh)
        else:
            make_mesh(mesh, devices=config.training.mesh_devices)
    except MeshError as error:
        raise RecipeError(f"--mesh {mesh!r}: {error}") from None


def _check_data(data: str | None) -> None:
    """Local --data that names no file, or only empty ones, refused before the run folder is written (the text
    itself is read, and checked, once the teacher's tokenizer is known)."""
    if not isinstance(data, str) or not data or data.startswith("hf:"):
        return
    try:
        files = sources.expand_paths(data)
    except distill.DataError as error:
        raise RecipeError(f"--data: {error}") from None
    named_empty = os.path.isfile(data) and os.path.getsize(data) < 1 << 20 and \
        not sources.read_text(data).strip()
    if named_empty or all(os.path.getsize(path) == 0 for path in files):
        raise RecipeError(f"--data {data}: no text there (empty); pass files with text in them.")


def _check_general_source(config: RecipeConfig) -> None:
    """--general-source packages or pydoc+packages (`PACKAGED_SOURCES`): the prose extra's packages installed,
    before a run reads or writes anything (a dry run, --print-config or --aot reads no text: not needed there)."""
    run, source = config.run, config.data.general_source
    if not config.data.general_mix or source not in PACKAGED_SOURCES or run.dry_run or run.print_config \
            or config.aot.target:
        return
    try:
        for package in packaged_prose.PACKAGES:
            packaged_prose.installed_path(package)
    except distill.DataError as error:
        raise RecipeError(f"--general-source {source}: {error}") from None


def _check_budget(student: str | None) -> None:
    """A `--student params=` budget readable now (a fraction up to 1, or a count), before anything is written."""
    for item in (student or "").split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key == "params":
            try:
                parse_budget(value)
            except surgery.SpecError as error:
                raise RecipeError(f"--student {student!r}: {error}") from None


def _cache_folder(teacher_cache: str) -> str | None:
    """--teacher-cache when it names a folder (not none, auto or always)."""
    return None if teacher_cache in ("none", "auto", "always") else teacher_cache


def _check_output(config: RecipeConfig) -> None:
    """--output never an input the run reads (--teacher, --data, --cache-dir, --teacher-cache) nor inside one or
    holding one, and writable (not in a dry run, which writes nothing): --overwrite deletes
    it (--config is read whole before that: `--config RUN/resolved_config.json --output RUN` repeats or resumes a
    run); and --push-to-hub's token and Hub checked now, not after the run."""
    run = config.run
    cache = run.cache_dir
    if cache and os.path.lexists(cache) and not os.path.isdir(cache):
        raise RecipeError(f"--cache-dir {cache}: {wrong_kind(cache, 'folder')}; give a folder for the cached teachers "
                          "(made when missing).")
    if run.output is not None:  # the cache holds the tiny teacher and imported GGUFs the run reads
        guard_folder(run.output, "--output", input_paths(config.teacher.model, config.data.files, cache,
                                                         _cache_folder(config.training.teacher_cache)),
                     probe=not run.dry_run)
    if run.push_to_hub and not run.print_config:
        check_push_access(run.push_to_hub)


__all__ = ["check_settings", "check_devices", "named_by_flags", "flag_names"]
