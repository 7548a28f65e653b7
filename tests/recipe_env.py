"""The environment tests run the recipes in: CPU, offline, and caches shared by the whole test session.

A recipe run that compiles what an earlier run of the session compiled (the same shapes: a resumed run, the same
tiny teacher evaluated again, a dry run) loads the executable from the cache instead of compiling it again; the
executables are the same, and compiling is most of a tiny run's time. Every test that runs a recipe in a
subprocess shares one cache per pytest session unless it names its own. Under `pytest -n 2` the session's two
worker processes share it too (`shared_basetemp`): JAX then guards each read and write of the cache with a file
lock (it does so when the cache has a size limit), so one worker's compilations serve the other's runs.

The tiny teacher most recipe tests distil from (`TINY_TEACHER`'s flags) is trained once per session by the
`tiny_teacher_cache` fixture (tests/conftest.py) under a lock, whichever worker asks first; the others wait for it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")  # the 7B -> 2B recipe script

# The flags that decide the tiny teacher (tiny_teacher.prepare's cache key): a module whose runs use these shares
# the session's teacher.
TINY_TEACHER = ["--preset", "tiny", "--teacher-steps", "40", "--corpus-bytes", "150000", "--batch-size", "4",
                "--seq-len", "32"]
COMPILE_CACHE_LIMIT = 8 << 30  # far above what a session writes; a limit is what turns JAX's cache lock on


def with_host_devices(count: int) -> str:
    """XLA_FLAGS for a subprocess with `count` CPU devices, keeping the flags the session already set (conftest's
    compilation without LLVM's optimisation)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


def result_on_host_devices(script: str, count: int, timeout: int = 600) -> dict:
    """Run `script` (`python -c`, from the checkout) in a process of its own with `count` CPU devices (the device
    count is fixed when jax starts) and return the JSON of its last line starting "RESULT "."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": with_host_devices(count), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def shared_basetemp(tmp_path_factory) -> Path:
    """The base temporary folder of the whole test session: under pytest-xdist each worker's own base folder lies
    in the session's, so caches made here are made once per session instead of once per worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def file_lock(path: Path | str):
    """An exclusive lock held on the file `path` (created when missing) by one process of this machine at a time.
    A second lock of the same file from the same process waits forever: take it once."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_cache_env(compile_cache: Path | str) -> dict[str, str]:
    """The variables that make a child process read and write the compilation cache at `compile_cache`, for
    every executable (the defaults skip fast compilations, which are all of a tiny model's), each read and write
    under JAX's lock of that folder."""
    return {"JAX_COMPILATION_CACHE_DIR": str(compile_cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(COMPILE_CACHE_LIMIT)}


def recipe_env(basetemp: Path, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) on CPU, offline, with the compilation cache in `basetemp`
    (give `shared_basetemp(...)` to share it with the session's other workers)."""
    return {**(os.environ if base is None else base), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
            **compile_cache_env(Path(basetemp) / "jax-compile-cache"), **extra}
