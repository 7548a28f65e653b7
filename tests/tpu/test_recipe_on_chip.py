"""The tiny recipe on a TPU chip (the `tpu` marker: skipped where JAX has no TPU, as in CI), in child processes:
run apart from test_on_chip.py (`make test-tpu` starts a pytest per module), since a test process that has opened
the chip holds it and a child could not."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.tpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipe(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py"), "--preset", "tiny",
                           "--steps", "20", *extra], capture_output=True, text=True, timeout=900, cwd=ROOT)


def _first_records(metrics: str) -> list[dict]:
    """The history records of `metrics` (metrics.jsonl) that carry a compile report: one per compiled program."""
    with open(metrics) as handle:
        return [r for r in map(json.loads, handle) if "compile_s" in r]


@pytest.mark.slow
def test_the_tiny_recipe_runs_on_the_chip_and_a_resume_does_not_recompile(tmp_path):
    """The tiny recipe end to end, stopped after its 10th distillation step and resumed: the resumed process
    loads the train step from the run's persistent compilation cache (JAX's own cache event) instead of compiling
    it again."""
    run, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    halted = _recipe("--output", run, "--cache-dir", cache, "--halt-after", "stage_b:10")
    assert halted.returncode != 0 and not os.path.exists(os.path.join(run, "results.json")), halted.stdout[-2000:]
    metrics = os.path.join(run, "logs", "stage_b", "metrics.jsonl")
    assert os.path.isfile(metrics), halted.stdout[-3000:] + halted.stderr[-3000:]
    before = _first_records(metrics)
    assert before and before[0]["compile_cache"] == "miss", before
    done = _recipe("--output", run, "--cache-dir", cache, "--resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert os.path.isfile(os.path.join(run, "results.json"))
    resumed = _first_records(metrics)[len(before):]
    assert resumed and resumed[0]["compile_cache"] == "hit", resumed
