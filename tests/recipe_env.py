"""The environment tests run the recipes in: CPU, offline, and a persistent JAX compilation cache.

A recipe run that compiles what an earlier run of the session compiled (the same shapes: a resumed run, the same
tiny teacher evaluated again, a dry run) loads the executable from the cache instead of compiling it again; the
executables are the same, and compiling is most of a tiny run's time. Every test that runs a recipe in a
subprocess shares one cache per pytest session (under its base temporary folder) unless it names its own.
"""
from __future__ import annotations

import os
from pathlib import Path


def compile_cache_env(compile_cache: Path | str) -> dict[str, str]:
    """The variables that make a child process read and write the compilation cache at `compile_cache`, for
    every executable (the defaults skip fast compilations, which are all of a tiny model's)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(compile_cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def recipe_env(basetemp: Path, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) on CPU, offline, with the session's compilation cache."""
    return {**(os.environ if base is None else base), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
            **compile_cache_env(Path(basetemp) / "jax-compile-cache"), **extra}
