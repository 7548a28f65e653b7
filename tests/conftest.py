"""Fixtures shared by the whole test session (and by both workers of `pytest -n 2`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipe_env import TINY_TEACHER, file_lock, recipe_env, shared_basetemp

_PREPARE = ("import sys\nfrom nnx_surgery.recipes import compress, tiny_teacher\n"
            "print(tiny_teacher.prepare(compress.parse_args(sys.argv[1:]))[0])")


@pytest.fixture(scope="session")
def tiny_teacher_cache(tmp_path_factory) -> Path:
    """The recipe's --cache-dir for the session, holding the tiny teacher of `TINY_TEACHER`'s flags: trained by
    the first worker that asks (the recipe's own `tiny_teacher.prepare`, in a subprocess like the recipe runs),
    under a lock the other worker waits on, instead of once per worker and at the same time."""
    shared = shared_basetemp(tmp_path_factory)
    cache = shared / "recipe-cache"
    with file_lock(shared / "recipe-cache.lock"):
        proc = subprocess.run([sys.executable, "-c", _PREPARE, *TINY_TEACHER, "--cache-dir", str(cache),
                               "--output", str(shared / "tiny-teacher-run")], capture_output=True, text=True,
                              env=recipe_env(shared), timeout=900)
    assert proc.returncode == 0, f"training the tiny teacher failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return cache
