"""JAX's persistent compilation cache as recipe runs keep it (recipes.compress.compile_cache): off on the CPU, and where it
is on, a second process running the same train step loads the executable instead of compiling it (the step's
`compile_cache` in the run's history says which, from JAX's own cache events), as a resumed run on a TPU does."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from nnx_surgery.recipes.compress import compile_cache

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from nnx_surgery.recipes.compress import compile_cache
compile_cache.enable(sys.argv[1], on_cpu=True)
from distill_fixtures import FAST_COMPILE, student_from, tiny_teacher, teacher_samples
from nnx_surgery.distill import TokenBatches
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.loop.trainer import run
import numpy as np
teacher = tiny_teacher(seed=1)
rng = np.random.default_rng(0)
docs = [rng.integers(3, 64, size=int(n)) for n in rng.integers(5, 40, size=24)]
data = TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=4, seed=3)
config = DistillConfig(stages=(Stage(steps=2, learning_rate=1e-3, weights=LossWeights.mixed(0.5)),), batch_size=4,
                       seq_len=16, progress=False, plots=False, logit_chunk=16)
result = run(teacher, student_from(teacher), data, config)
print(json.dumps(result.history[0]))
"""


def test_the_cache_is_off_on_the_cpu(tmp_path):
    assert compile_cache.enable(str(tmp_path)) is None and not os.listdir(tmp_path)


def test_without_the_cache_a_compile_says_nothing_of_it(tmp_path):
    code = ONE_RUN.format(tests=HERE).replace("compile_cache.enable(sys.argv[1], on_cpu=True)", "")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["compile_s"] > 0 and "compile_cache" not in first, first


def test_a_second_process_loads_the_step_it_compiled(tmp_path):
    folder = str(tmp_path / "run")
    code = ONE_RUN.format(tests=HERE)
    firsts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        firsts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert os.listdir(os.path.join(folder, compile_cache.FOLDER))
    assert [first["compile_cache"] for first in firsts] == ["miss", "hit"], firsts
    assert firsts[1]["compiled_bytes"] == firsts[0]["compiled_bytes"]


def test_a_cache_folder_given_to_jax_is_kept(tmp_path):
    """JAX_COMPILATION_CACHE_DIR (or jax.config) names a folder: runs in other folders share it."""
    shared = str(tmp_path / "shared")
    code = ("import jax, sys; jax.config.update('jax_compilation_cache_dir', sys.argv[2]); "
            "from nnx_surgery.recipes.compress import compile_cache; print(compile_cache.enable(sys.argv[1], on_cpu=True))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), shared], capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.strip() == shared
