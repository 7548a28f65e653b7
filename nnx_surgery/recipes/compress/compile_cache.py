"""JAX's persistent compilation cache for a run on an accelerator: `<run folder>/xla-cache`.

A program's first step on a TPU compiles for 35-78 s (the tiny recipe spends most of its time there). With the
cache, a resumed run (`--resume`) and every later program of the same shapes load the executables the earlier
ones compiled instead of compiling them again; the first step of each program records `compile_s` and, from
JAX's own cache event, `compile_cache` ("hit" or "miss") in the run's history.
On the CPU the cache stays off: compiling there is quick, and the CPU runs and their folders stay as they were.
A cache folder the user gave JAX (`JAX_COMPILATION_CACHE_DIR`, or `jax.config` before the run) is kept: runs of
the same shapes in different folders (bench/demo_budget_curve.py's scales) then share their compiles.
"""
from __future__ import annotations

import os

import jax

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


__all__ = ["FOLDER", "enable"]
