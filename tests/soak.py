"""The soak's machinery (tests/recipes/test_recipe.py): a recipe run SIGKILLed at seeded random points of its distillation
and resumed each time with --resume, then run to its end.

The kill points come from a seeded RNG (SOAK_SEED to vary it) and are printed: each is a delay after a progress mark
(a checkpoint or a finished phase appearing on disk). One always falls between the two distillation phases, where
the data position is in memory only. A failure names the kill points, so the run can be repeated.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable

KILLS = 5
DELAY_S = (0.0, 1.2)


def marks(stage_a_steps: int, stage_b_steps: int, every: int) -> tuple[list[str], int]:
    """A run's progress marks in order, and the index of the gap after stage A. A checkpoint folder appears when
    its write completes (every `every` steps, the phase's first and last step), a phase folder when the phase is
    saved; the data position lives only in memory from the end of stage A to the first stage-B checkpoint."""
    def saved(steps: int) -> list[int]:
        return sorted(set(range(0, steps + 1, every)) | {steps})

    found = ([f"checkpoints/stage_a/{step}" for step in saved(stage_a_steps)] + ["phases/stage_a"]
             + [f"checkpoints/stage_b/{step}" for step in saved(stage_b_steps)] + ["phases/stage_b"])
    return found, found.index("phases/stage_a")


class Output:
    """Collects a child's output (stdout and stderr together) in a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            self.text += chunk.decode("utf-8", "replace")

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.text.replace("\r", "\n").splitlines()[-lines:])


def kill_points(seed: int, count: int, gap: int) -> list[tuple[int, float]]:
    """KILLS (mark index, delay) pairs in the order of progress: the gap after stage A and random others."""
    rng = random.Random(seed)
    others = rng.sample([i for i in range(count) if i != gap], KILLS - 1)
    return [(mark, round(rng.uniform(*DELAY_S), 2)) for mark in sorted(others + [gap])]


def kill_after(start: Callable[[], subprocess.Popen], output, run_marks: list[str], mark: int,
               delay: float) -> tuple[str | None, str]:
    """Start a resumed run and SIGKILL it `delay` s after run_marks[mark] appears, or when the next mark appears if
    that comes first (so a kill never gets past the next kill point). A mark the earlier run already passed moves
    to the first one it did not. Returns (where it was killed, None if it finished first; its last output)."""
    def reached(index: int) -> bool:
        return index < len(run_marks) and os.path.exists(os.path.join(output, run_marks[index]))

    while mark < len(run_marks) - 1 and reached(mark):
        mark += 1
    proc = start()
    out = Output(proc)
    while proc.poll() is None and not reached(mark):
        time.sleep(0.005)
    deadline = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < deadline and not reached(mark + 1):
        time.sleep(0.005)
    where = f"{delay} s after {run_marks[mark]}"
    if reached(mark + 1):
        where = f"as {run_marks[mark + 1]} appeared, {time.monotonic() - deadline + delay:.2f} s after {run_marks[mark]}"
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=600)
    out.thread.join(timeout=10)
    if not killed:
        assert code == 0, f"run failed ({code}):\n{out.tail(40)}"
    return (where if killed else None), out.tail(3)


def finish(start: Callable[[], subprocess.Popen]) -> str:
    """Run to the end; returns its output."""
    proc = start()
    out = Output(proc)
    code = proc.wait(timeout=900)
    out.thread.join(timeout=10)
    assert code == 0, f"run failed ({code}):\n{out.tail(40)}"
    return out.text


def soak(start: Callable[[], subprocess.Popen], output, run_marks: list[str], gap: int, seed: int) -> tuple[str, str]:
    """KILLS killed runs of `start` (which resumes the run in `output`), then one to the end; returns the kill
    points as text and the last run's output."""
    points = kill_points(seed, len(run_marks), gap)
    print(f"SOAK_SEED={seed}: kill points {[(run_marks[m], d) for m, d in points]}", flush=True)
    kills: list[str] = []
    for mark, delay in points:
        where, tail = kill_after(start, output, run_marks, mark, delay)
        last = " | ".join(line.strip()[:90] for line in tail.splitlines() if line.strip())
        kills.append(f"SIGKILL {where}; last output: {last}" if where else "finished before its kill point")
        print(f"kill {len(kills)}: {kills[-1]}", flush=True)
    report = f"SOAK_SEED={seed}:\n  " + "\n  ".join(kills)
    assert sum(k.startswith("SIGKILL") for k in kills) >= KILLS, report
    return report, finish(start)
