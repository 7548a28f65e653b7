"""Compiling out of the chip's way, on an accelerator: JAX's persistent compilation cache (`<run folder>/xla-cache`),
and a phase's step compiled ahead, in a thread, while the phase before it runs (--compile-ahead).

A program's first step on a TPU compiles for 35-78 s (the tiny recipe spends most of its time there). With the
cache, a resumed run (`--resume`) and every later program of the same shapes load the executables the earlier
ones compiled instead of compiling them again; the first step of each program records `compile_s` and, from
JAX's own cache event, `compile_cache` ("hit" or "miss") in the run's history.
On the CPU the cache stays off: compiling there is quick, and the CPU runs and their folders stay as they were.
A cache folder the user gave JAX (`JAX_COMPILATION_CACHE_DIR`, or `jax.config` before the run) is kept: runs of
the same shapes in different folders (bench/demo_budget_curve.py's scales) then share their compiles.

Compiled ahead (`distill.compile_ahead`): the distillation's step while the MLP refit runs, the control's while the
distillation trains; the phase then calls the executables its thread made (its first step records
`compile_reused`) and waits only for what is not finished.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax

from nnx_surgery import distill
from nnx_surgery.recipes.compress import phase_configs
from nnx_surgery.recipes.compress.run_settings import RunSettings

FOLDER = "xla-cache"


def enable(run_folder: str, *, on_cpu: bool = False) -> str | None:
    """Point JAX's persistent cache at `run_folder`/xla-cache on an accelerator (every compile of a second or more
    is kept); the folder, or None on the CPU (unless `on_cpu`: the tests' way to exercise it without a TPU).
    Where JAX already has a cache folder, that one (module docstring)."""
    if jax.default_backend() == "cpu" and not on_cpu:
        return None
    # (getattr: JAX makes its flags attributes at run time, which the type checker cannot see)
    folder = getattr(jax.config, "jax_compilation_cache_dir") or os.path.join(run_folder, FOLDER)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def compiles_ahead(run: RunSettings) -> bool:
    """--compile-ahead: "auto" is on an accelerator (a TPU compiles a step for about a minute while the chip
    waits), not on the CPU, whose cores the phase running meanwhile already uses."""
    wanted = run.config.run.compile_ahead
    return wanted == "on" or (wanted == "auto" and jax.default_backend() != "cpu")


def ahead_of(run: RunSettings, phase: str, teacher: Any, student: Any, data: Any,
             config: Callable[[], Any]) -> distill.CompileAhead | None:
    """`phase`'s first step and evaluation compiling in a thread from now (`distill.compile_ahead`; `student` a
    model of the structure it trains, `config()` its DistillConfig), so that it starts at once when the phase
    before it is done. None where --compile-ahead says no (auto: on the CPU), when an earlier run finished the
    phase, or when it trains from a teacher cache (another program); a setup that fails only costs the time."""
    if not compiles_ahead(run) or os.path.exists(os.path.join(run.folder, "phases", phase, "history.json")) or (
            teacher is not None and run.config.training.teacher_cache != "none"):
        return None
    try:
        return distill.compile_ahead(teacher, student, data, config())
    except Exception as error:  # noqa: BLE001 - the phase compiles its step itself
        print(f"[{phase}] not compiled ahead ({type(error).__name__}: {error}); it compiles when it starts",
              flush=True)
        return None


def waited(ahead: distill.CompileAhead | None, phase: str, during: str) -> None:
    if ahead is not None:
        done = ahead.wait()
        print(f"[{phase}] compiled during {during}: {done['compiled_s']} s"
              + (f"; not compiled ahead ({done['error']}), so compiled now" if done["error"] else ""), flush=True)


def control_ahead(run: RunSettings, cut: Any, first: Any) -> distill.CompileAhead | None:
    """The control's programs compiling while the distillation trains (`ahead_of`; `cut`'s student, run_phases.Cut,
    stands in for the control's model; `first` is stage A's run_phases.StageA), or None without a control."""
    if run.config.student.control == "none":
        return None
    steps = first.steps + run.phase_config("stage_b", run.stages.stage_b, cut.lineage, cut.data).total_steps
    return ahead_of(run, "control", None, cut.student, cut.data,
                    lambda: run.phase_config("control", [phase_configs.control_stage(run.config, steps)]))


__all__ = ["FOLDER", "enable", "compiles_ahead", "ahead_of", "waited", "control_ahead"]
