"""Soak: a tiny recipe run killed with SIGKILL at random points of its distillation, resumed each time with
--resume, ends with the student an uninterrupted run makes, bit for bit (CPU): every tensor of model.safetensors
and every loss in results.json.

The kill points come from a seeded RNG (SOAK_SEED to vary it) and are printed: each is a delay after a progress mark
(a checkpoint or a finished phase appearing on disk). One always falls between the two distillation phases, where
the data position is in memory only. A failure names the kill points, so the run can be repeated.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from recipe_env import TINY_TEACHER, compile_cache_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
# The session's tiny teacher (TINY_TEACHER, trained once by tests/conftest.py). The evaluation compared at
# the end is smaller than the preset's (no generations or multiple choice, 1,024 held-out tokens per set); XLA:CPU
# without backend optimisation (the same for every run).
TINY = [*TINY_TEACHER, "--steps", "12", "--calibration-samples", "4", "--eval-prompts", "0", "--choice-items", "0",
        "--eval-tokens", "1024", "--control", "none", "--checkpoint-every", "1",
        "--set", 'compiler_options={"xla_backend_optimization_level": 0}']
KILLS = 5
STAGE_A_STEPS, STAGE_B_STEPS = 4, 8  # --steps 12 with the default --stage-a-fraction 0.3
# Progress marks of a run, in order: a checkpoint folder appears when its write completes, a phase folder when
# the phase is saved. A kill point is a mark and a delay after it.
MARKS = ([f"checkpoints/stage_a/{step}" for step in range(STAGE_A_STEPS + 1)] + ["phases/stage_a"]
         + [f"checkpoints/stage_b/{step}" for step in range(STAGE_B_STEPS + 1)] + ["phases/stage_b"])
GAP = MARKS.index("phases/stage_a")  # then the stage-B plan: the data position lives only in memory until the
# first stage-B checkpoint, so one kill always lands here
DELAY_S = (0.0, 1.2)


def _env(compile_cache) -> dict[str, str]:
    """CPU, offline, and a persistent compilation cache shared by the runs (the session's, tests/recipe_env.py): a
    resumed run loads what the first one compiled instead of compiling it again (the same executables; most of a
    tiny run's time)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            **compile_cache_env(compile_cache)}


def _start(output, cache, compile_cache, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, RECIPE, *TINY, "--output", str(output), "--cache-dir", str(cache),
                             *extra], env=_env(compile_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class Output:
    """Collects a child's output in a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            self.text += chunk.decode("utf-8", "replace")

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.text.replace("\r", "\n").splitlines()[-lines:])


def kill_points(seed: int) -> list[tuple[int, float]]:
    """KILLS (mark index, delay) pairs in the order of progress: the gap after stage A and random others."""
    rng = random.Random(seed)
    others = rng.sample([i for i in range(len(MARKS)) if i != GAP], KILLS - 1)
    return [(mark, round(rng.uniform(*DELAY_S), 2)) for mark in sorted(others + [GAP])]


def _kill_after(output, cache, compile_cache, mark: int, delay: float) -> tuple[str | None, str]:
    """Start a resumed run and SIGKILL it `delay` s after MARKS[mark] appears, or when the next mark appears if
    that comes first (so a kill never gets past the next kill point). A mark the earlier run already passed moves
    to the first one it did not. Returns (where it was killed, None if it finished first; its last output)."""
    def reached(index: int) -> bool:
        return index < len(MARKS) and os.path.exists(os.path.join(output, MARKS[index]))

    while mark < len(MARKS) - 1 and reached(mark):
        mark += 1
    proc = _start(output, cache, compile_cache, "--resume")
    out = Output(proc)
    while proc.poll() is None and not reached(mark):
        time.sleep(0.005)
    deadline = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < deadline and not reached(mark + 1):
        time.sleep(0.005)
    where = f"{delay} s after {MARKS[mark]}"
    if reached(mark + 1):
        where = f"as {MARKS[mark + 1]} appeared, {time.monotonic() - deadline + delay:.2f} s after {MARKS[mark]}"
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=600)
    out.thread.join(timeout=10)
    if not killed:
        assert code == 0, f"run failed ({code}):\n{out.tail(40)}"
    return (where if killed else None), out.tail(3)


def _finish(output, cache, compile_cache, *extra) -> str:
    proc = _start(output, cache, compile_cache, *extra)
    out = Output(proc)
    code = proc.wait(timeout=900)
    out.thread.join(timeout=10)
    assert code == 0, f"run failed ({code}):\n{out.tail(40)}"
    return out.text


def _tensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "student", "model.safetensors"))


def _losses(folder) -> dict:
    with open(os.path.join(folder, "results.json")) as handle:
        results = json.load(handle)
    return {"rows": [(row["model"], row["loss"], row["perplexity"]) for row in results["rows"]],
            "final_losses": results.get("final_losses")}


def _soak(output, cache, compile_cache, seed: int) -> str:
    """KILLS killed and resumed runs in `output`, then one to the end; returns the kill points as text."""
    points = kill_points(seed)
    print(f"SOAK_SEED={seed}: kill points {[(MARKS[m], d) for m, d in points]}", flush=True)
    kills: list[str] = []
    for mark, delay in points:
        where, tail = _kill_after(output, cache, compile_cache, mark, delay)
        last = " | ".join(line.strip()[:90] for line in tail.splitlines() if line.strip())
        kills.append(f"SIGKILL {where}; last output: {last}" if where else "finished before its kill point")
        print(f"kill {len(kills)}: {kills[-1]}", flush=True)
    report = f"SOAK_SEED={seed}:\n  " + "\n  ".join(kills)
    assert sum(k.startswith("SIGKILL") for k in kills) >= KILLS, report
    _finish(output, cache, compile_cache, "--resume")
    return report


@pytest.mark.slow
def test_killed_and_resumed_tiny_recipe_ends_bit_identical(tmp_path, tiny_teacher_cache):
    # the session's tiny teacher and compilation cache (tests/recipe_env.py)
    cache = tiny_teacher_cache
    compile_cache = cache.parent / "jax-compile-cache"
    started = time.monotonic()
    # The uninterrupted run and the soaked runs go side by side (two processes: most of a tiny run's time is
    # single-threaded tracing); the teacher is cached already.
    reference = _start(tmp_path / "full", cache, compile_cache)
    reference_out = Output(reference)
    try:
        report = _soak(tmp_path / "soaked", cache, compile_cache, int(os.environ.get("SOAK_SEED", "12")))
        code = reference.wait(timeout=900)
    finally:
        if reference.poll() is None:
            reference.kill()
    reference_out.thread.join(timeout=10)
    assert code == 0, f"the uninterrupted run failed ({code}):\n{reference_out.tail(40)}"
    print(f"soak: {time.monotonic() - started:.0f} s in all", flush=True)

    want, got = _tensors(tmp_path / "full"), _tensors(tmp_path / "soaked")
    assert sorted(got) == sorted(want), report
    differing = [name for name in want if not np.array_equal(want[name], got[name])]
    assert not differing, f"tensors differ after the kills: {differing[:6]}\n{report}"
    assert _losses(tmp_path / "soaked") == _losses(tmp_path / "full"), report
