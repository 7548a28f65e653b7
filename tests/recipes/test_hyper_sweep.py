"""bench/hyper_sweep.py on the tiny teacher: every variant and control starts from the same pruned student and reads
the same batches (a variant of plain CE is the control again, to the last digit), each is scored against every
control with paired intervals, and a rerun reads the trained students back instead of training them again."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipe_env import TINY_TEACHER, recipe_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "bench", "hyper_sweep.py")
PLAIN_CE, MIXED, CONTROL = ("distilled lr=0.001 alpha=0 t=1", "distilled lr=0.001 alpha=0.5 t=2",
                            "control lr=0.001")
RECIPE = [*TINY_TEACHER, "--steps", "6", "--student", "layers=2,mlp=24", "--compression", "oneshot",
          "--feature-weight", "0", "--calibration-samples", "8", "--eval-batches", "2", "--compile-ahead", "on"]


def sweep(output, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SWEEP, "--variants", "lr=1e-3,alpha=0 lr=1e-3,alpha=0.5,t=2",
                           "--controls", "1e-3", "--", *RECIPE, "--output", str(output), "--cache-dir", str(cache)],
                          capture_output=True, text=True, env=recipe_env(cache.parent), timeout=900)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_teacher_cache):
    output = tmp_path_factory.mktemp("hyper-sweep") / "run"
    first = sweep(output, tiny_teacher_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((output / "sweep.json").read_text())
    again = sweep(output, tiny_teacher_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    return output, record, first, again


@pytest.mark.slow  # the recipe's phases, three trainings and the evaluation
def test_every_variant_is_paired_with_every_control(swept):
    output, record, first, _ = swept
    rows = {row["model"]: row for row in record["results"]["rows"]}
    assert set(rows) == {"teacher", "pruned (before distillation)", PLAIN_CE, MIXED, CONTROL}
    assert set(record["versus"]) == {f"{PLAIN_CE} - {CONTROL}", f"{MIXED} - {CONTROL}"}
    for title, closed in record["closed"].items():
        assert set(closed) == {PLAIN_CE, MIXED, CONTROL}, title
    # plain CE with a teacher beside it trains the control's very steps: same start, same batches
    assert rows[PLAIN_CE]["loss"] == pytest.approx(rows[CONTROL]["loss"], rel=1e-5)
    for title, difference in record["versus"][f"{PLAIN_CE} - {CONTROL}"].items():
        assert abs(difference["difference"]) < 1e-4, (title, difference)
    assert rows[MIXED]["loss"] != pytest.approx(rows[CONTROL]["loss"], rel=1e-4)  # the KL term changes it
    histories = {name: json.loads((output / "phases" / name / "history.json").read_text())
                 for name in os.listdir(output / "phases")}
    assert len(histories) == 3
    digests = {name: [step["batch_digest"] for step in history["train"]] for name, history in histories.items()}
    assert len({tuple(d) for d in digests.values()}) == 1 and len(next(iter(digests.values()))) == 6
    assert len({history["start"]["weights"] for history in histories.values()}) == 1
    # --compile-ahead on: the variants' step compiled while the control trained, and the first variant ran it
    assert "[sweep] the variants' step compiled while the controls trained: {'compiled_s': {'train step':" in \
        first.stdout
    first_steps = {name: history["train"][0] for name, history in histories.items()}
    assert first_steps["sweep-distilled_lr0.001_alpha0_t1"].get("compile_reused") is True, first_steps
    assert "compile_reused" not in first_steps["sweep-control_lr0.001"]
    table = (output / "sweep.md").read_text()
    assert f"| {MIXED} - {CONTROL} |" in table and "in-domain closed" in table


@pytest.mark.slow
def test_a_rerun_reads_the_trained_students_back(swept):
    output, record, _, again = swept
    assert again.stdout.count("finished in an earlier run") == 3
    rerun = json.loads((output / "sweep.json").read_text())
    assert rerun["closed"] == record["closed"] and rerun["versus"] == record["versus"]


def test_variants_take_their_defaults_and_bad_ones_are_refused_in_one_line():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import hyper_sweep

    assert hyper_sweep.parse_variants("lr=1e-4 lr=2e-5,alpha=1,t=2") == [
        hyper_sweep.Variant(learning_rate=1e-4, alpha=0.5, temperature=1.0),
        hyper_sweep.Variant(learning_rate=2e-5, alpha=1.0, temperature=2.0)]
    for bad, says in (("alpha=0.5", "needs lr="), ("lr=1e-4,beta=1", "'beta'"), ("lr=x", "needs a number"),
                      ("lr=1e-4,alpha=2", "an alpha from 0 to 1")):
        with pytest.raises(SystemExit, match=says):
            hyper_sweep.parse_variants(bad)
