"""Fixtures shared by the whole test session (and by both workers of `pytest -n 2`)."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_env import TINY_TEACHER, file_lock, recipe_env, shared_basetemp

# Under `pytest -n 2` the two workers share the two cores, so PyTorch's OpenMP threads (two per process by default)
# wait on a core the other worker holds: the real 270M's greedy generation in transformers, the reference of
# test_generate, ran 4x slower per token beside a busy process with two threads than with one (bench/NOTES.md). One
# thread per worker, set before torch is imported (its subprocesses inherit it); JAX's thread pool gained nothing
# from the same treatment, so it keeps its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# XLA:CPU without LLVM's optimisation passes, for the test processes and every process they start (recipe runs,
# multi-host workers, the mesh tests' subprocesses through recipe_env.with_host_devices): the suite compiles
# thousands of small programs and runs each a few times, so compiling is most of its time. Measured in alternating
# runs (bench/NOTES.md): in-process modules 15-20% faster, a tiny recipe run with a cold compilation cache 20% less
# CPU; the real 270M's greedy generation runs slower (48 s -> 66 s), which the rest outweighs. Set before anything
# starts JAX's CPU client, which reads the variable once.
# `make test-tpu` (NNX_SURGERY_TEST_TPU=1) keeps XLA's normal level: the TPU's compiler reads the flag too, and the
# chip's tests measure the programs a run executes.
if not os.environ.get("NNX_SURGERY_TEST_TPU"):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# The modules that take longest (per-module wall time of a quiet 2-core run, bench/NOTES.md), slowest first. `make
# test` hands modules to its two workers in collection order (--no-loadscope-reorder), so these start first and
# the short ones fill in at the end, instead of a long module starting last and running alone. The second is one
# that does not wait for the session's tiny teacher, which the first trains. Modules not listed follow, in their
# own order.
SLOWEST_FIRST = ["tests/recipes/test_recipe.py", "tests/surgery/modeling/test_generate.py", "tests/recipes/test_recipe_vocab.py",
                 "tests/recipes/test_config_surface.py", "tests/recipes/test_recipe_search.py", "tests/recipes/test_recipe_pairing.py",
                 "tests/recipes/aot/test_aot.py", "tests/evaluation/test_lm_eval_backend.py", "tests/distill/test_multihost.py", "tests/surgery/modeling/test_llama.py",
                 "tests/distill/loop/test_interrupt.py", "bench/test_bench.py", "tests/surgery/modeling/test_tunix.py", "tests/surgery/storage/test_gguf.py",
                 "tests/commands/test_command_line.py", "tests/commands/test_refusals.py", "tests/distill/loop/test_distill_train.py",
                 "tests/distill/test_distill_mesh.py", "tests/surgery/modeling/test_layer_remat.py", "tests/distill/inputs/test_distill_teacher_cache.py",
                 "tests/recipes/test_distill_then_dpo.py", "tests/evaluation/test_search.py", "tests/evaluation/test_suite.py"]


def pytest_collection_modifyitems(config, items) -> None:
    """The slowest modules first (SLOWEST_FIRST); a stable sort, so tests keep their order within a module. Tests
    marked `tpu` are skipped unless JAX's default backend is a TPU (CI has none)."""
    rank = {module: index for index, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module_of(item), len(rank)))
    on_chip = [item for item in items if hasattr(item, "get_closest_marker") and item.get_closest_marker("tpu")]
    if on_chip and not _has_tpu():
        skip = pytest.mark.skip(reason="needs a TPU (make test-tpu on a TPU machine)")
        for item in on_chip:
            item.add_marker(skip)


def _has_tpu() -> bool:
    """Asked in a process of its own that exits (nnx_surgery.recipes.demo_choice.probe): a test process that has
    opened the chip would hold it, and the on-chip tests that start the recipe in a child process need it free."""
    from nnx_surgery.recipes.demo_choice import probe
    return probe(timeout=120).platform == "tpu"


def _module_of(item) -> str:
    """The test's module as SLOWEST_FIRST names it (its node id's path)."""
    return item.nodeid.split("::")[0]


# Each full collection of Python's cyclic garbage collector walks every tracked object, and a test worker's heap
# holds all that earlier modules imported, built and cached. The trainer collects before handing freed memory back
# to the OS (nnx_surgery/distill/loop/step_runner.py `release_free_heap`), so in three trainer modules those collections
# were 14% of the time (bench/NOTES.md). Each module therefore starts with one full collection, and what survives
# it is frozen (`gc.freeze`: left out of later collections; reference counting still frees it), so the
# collections inside a module walk only what that module made.
_module_running: str | None = None


def pytest_runtest_setup(item) -> None:
    global _module_running
    if _module_of(item) != _module_running:
        _module_running = _module_of(item)
        gc.collect()
        gc.freeze()


_PREPARE = ("import sys\nfrom nnx_surgery.recipes.inputs import tiny_teacher\nfrom nnx_surgery.recipes import compress_command\n"
            "print(tiny_teacher.prepare_for(compress_command.parse_args(sys.argv[1:]))[0])")


@pytest.fixture
def default_signal_handlers():
    """The test runs with Python's default SIGINT/SIGTERM handlers, whatever earlier tests of this process left,
    and theirs come back after. Its children inherit them: a signal left ignored here (SIG_IGN, which code run by
    earlier tests may set) would stay ignored in a child, and the toolkit deliberately leaves an ignored signal
    ignored (as under nohup), so a test sending SIGINT to a child would wait for a child that never heard it. (Not
    a preexec_fn: that forks the threaded JAX process before exec.)"""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


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
