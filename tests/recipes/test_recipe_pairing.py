"""The control is paired with the distillation: the same pruned student, the same batches in the same order.

A one-shot cut whose distillation is plain CE (alpha 0, no feature term, a student without merged KV heads, so one
stage) and a pruned-CE control are the same training twice: with paired batches and identical starts their
per-step losses agree. The control used to read the batches after the distillation's, which this catches. The
same run interrupted in the distillation and in the control and resumed (--halt-after, --resume) must pair too,
and end with the uninterrupted run's losses.

The runs are in bf16 (--precision bf16, as the gemma3-270m-tpu preset's one-shot cut with a pruned-CE control):
every model folder is stored in the run's precision, the pruned student's (run_phases.in_precision: bfloat16 here,
though the tiny teacher's files are float32); the float32 master weights live only in training and the
checkpoints. The resumed run reads the finished distillation back from its folder and must report the very
figures and write the very student of the uninterrupted run: the figures are those of the saved weights. (Phases
used to be read back in float32, so a resumed bf16 run wrote a float32 student and scored it with programs of its
own, to other figures.)
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from nnx_surgery import distill
from nnx_surgery.recipes.compress.reporting import pairing_lines
from recipe_env import TINY_TEACHER, recipe_env
from recipe_env import RECIPE

STEPS = 8
PAIRED_CE = [*TINY_TEACHER, "--steps", str(STEPS), "--student", "layers=2,mlp=24", "--compression", "oneshot",
             "--control", "pruned-ce", "--alpha", "0", "--feature-weight", "0", "--calibration-samples", "8",
             "--eval-prompts", "0", "--choice-items", "0", "--eval-batches", "2", "--precision", "bf16"]
STUDENTS = ("student", "phases/stage_b", "phases/control")  # the distilled student (folder and phase), the control


def run(output, cache, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, RECIPE, *PAIRED_CE, "--output", str(output), "--cache-dir", str(cache),
                           *extra], capture_output=True, text=True, env=recipe_env(cache.parent), timeout=900)


def histories(folder) -> dict[str, list[dict]]:
    return {phase: json.loads((folder / "phases" / phase / "history.json").read_text())["train"]
            for phase in ("stage_b", "control")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_teacher_cache):
    base = tmp_path_factory.mktemp("pairing")
    cache = tiny_teacher_cache
    whole = run(base / "whole", cache, "--compile-ahead", "on")  # steps compiled during the refit and stage B
    assert whole.returncode == 0, whole.stderr[-3000:]
    stops = []
    for extra in (["--halt-after", "stage_b:3"], ["--resume", "--halt-after", "control:5"], ["--resume"]):
        stops.append(run(base / "resumed", cache, *extra))
    return base, whole, stops


@pytest.mark.slow  # recipe runs end to end
def test_plain_ce_distillation_and_the_ce_control_take_the_same_steps(runs):
    base, whole, _ = runs
    logged = histories(base / "whole")
    distilled, control = logged["stage_b"], logged["control"]
    assert [r["step"] for r in distilled] == [r["step"] for r in control] == list(range(1, STEPS + 1))
    for mine, theirs in zip(distilled, control):
        assert mine["batch_digest"] == theirs["batch_digest"], (mine["step"], mine, theirs)
        np.testing.assert_allclose(mine["student_ce"], theirs["student_ce"], rtol=1e-6, err_msg=str(mine["step"]))
        np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-6, err_msg=str(mine["step"]))
    assert len({r["batch_digest"] for r in distilled}) == STEPS  # each step a batch of its own
    results = json.loads((base / "whole" / "results.json").read_text())
    pairing = results["pairing"]
    assert pairing["batches"] == {"same": True, "agreeing_steps": STEPS, "steps": [STEPS, STEPS]}
    assert pairing["same_start"] is True
    assert pairing["distillation"]["start_weights"] == pairing["control"]["start_weights"]
    assert pairing["distillation"]["batch_digests"] == [r["batch_digest"] for r in distilled]
    assert "read the same batches, same order" in (base / "whole" / "results.md").read_text()
    assert "from bit-identical starting weights" in whole.stdout
    assert "same batches, same order" in (base / "whole" / "student" / "README.md").read_text()  # the model card
    # the same students: plain CE twice from one start on one sequence
    rows = {r["model"]: r for r in results["rows"]}
    control_name = next(name for name in rows if "control" in name)
    assert rows["distilled student"]["loss"] == pytest.approx(rows[control_name]["loss"], rel=1e-5)


@pytest.mark.slow
def test_the_steps_compiled_ahead_are_the_ones_the_phases_run(runs):
    """--compile-ahead on: the distillation's first step reuses the program compiled while the MLP refit ran, the
    control's the one compiled while the distillation trained (no compile of their own), and both train to the very
    losses of the resumed runs, which compiled them themselves (the CPU's "auto" is off)."""
    base, whole, _ = runs
    assert "[stage_b] compiled during the refit: {'train step':" in whole.stdout, whole.stdout[-2000:]
    assert "[control] compiled during the distillation: {'train step':" in whole.stdout, whole.stdout[-2000:]
    logged, resumed = histories(base / "whole"), histories(base / "resumed")
    for phase in ("stage_b", "control"):
        assert logged[phase][0]["compile_reused"] is True, (phase, logged[phase][0])
        assert "compile_reused" not in resumed[phase][0]
        assert [r["loss"] for r in resumed[phase]] == [r["loss"] for r in logged[phase]]


@pytest.mark.slow
def test_interrupted_and_resumed_phases_pair_on_the_uninterrupted_runs_batches(runs):
    base, _, stops = runs
    assert [p.returncode for p in stops] == [3, 3, 0], [p.stderr[-2000:] for p in stops]
    assert "finished in an earlier run" in stops[2].stdout  # stage B read back, its recorded start reused
    whole, resumed = histories(base / "whole"), histories(base / "resumed")
    digests = [r["batch_digest"] for r in whole["stage_b"]]
    for phase in ("stage_b", "control"):
        assert [r["batch_digest"] for r in resumed[phase]] == digests, phase
        assert [r["student_ce"] for r in resumed[phase]] == [r["student_ce"] for r in whole[phase]], phase
    pairing = json.loads((base / "resumed" / "results.json").read_text())["pairing"]
    assert pairing["batches"]["same"] and pairing["same_start"] is True
    for phase in ("stage_b", "control"):
        start = json.loads((base / "resumed" / "phases" / phase / "history.json").read_text())["start"]
        assert start["data"]["position"] == 0 and start["data"]["epoch"] == 0, (phase, start)


def stored_dtypes(folder) -> set[str]:
    """The dtypes of the tensors in `folder`'s safetensors files, read from their headers."""
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        dtypes |= {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return dtypes


@pytest.mark.slow
def test_every_student_folder_is_stored_in_the_pruned_students_bf16(runs):
    base = runs[0]
    for folder in (base / "whole", base / "resumed"):
        for name in STUDENTS:
            assert stored_dtypes(folder / name) == {"BF16"}, (folder.name, name)
        assert json.loads((folder / "student" / "config.json").read_text())["torch_dtype"] == "bfloat16"
        # the evaluated models' own bytes (parameters x their dtype's size): the pruned student's, in bfloat16
        rows = {row["model"]: row for row in json.loads((folder / "results.json").read_text())["rows"]}
        control = next(name for name in rows if "control" in name)
        sizes = {rows[name]["safetensors_bytes"] for name in ("pruned (before distillation)", "distilled student",
                                                              control)}
        assert sizes == {2 * rows["distilled student"]["parameters"]}, (folder.name, sizes)


@pytest.mark.slow
def test_a_resumed_run_reports_the_figures_of_the_saved_students(runs):
    base = runs[0]
    whole, resumed = (json.loads((base / name / "results.json").read_text()) for name in ("whole", "resumed"))
    assert resumed["rows"] == whole["rows"]
    assert resumed["sets"] == whole["sets"]
    assert (base / "resumed" / "student" / "model.safetensors").read_bytes() == \
        (base / "whole" / "student" / "model.safetensors").read_bytes()


def _results(distilled: list[str], control: list[str], starts=("w1", "w1"), same_start=True) -> dict:
    record = {"distillation": {"phases": ["stage_b"], "start_weights": starts[0], "batch_digests": distilled,
                               "batch_sequence": "s1"},
              "control": {"start_weights": starts[1], "batch_digests": control, "batch_sequence": "s2"},
              "batches": distill.compare_sequences(distilled, control), "same_start": same_start}
    return {"rows": [{"model": "CE-retrained pruned student (control)"}], "pairing": record}


def test_results_md_claims_same_batches_only_when_every_digest_agrees():
    paired = " ".join(pairing_lines(_results(["a", "b"], ["a", "b"])))
    assert "same batches, same order" in paired and "bit-identical starting weights (w1)" in paired
    shifted = " ".join(pairing_lines(_results(["a", "b"], ["b", "c"])))
    assert "same batches" not in shifted and "NOT paired" in shifted and "0 of 2 steps" in shifted
    other_start = " ".join(pairing_lines(_results(["a"], ["a"], ("w1", "w2"), same_start=False)))
    assert "NOT from the same starting weights" in other_start
    assert pairing_lines({"rows": [], "pairing": {"distillation": {}}}) == []  # --control none
