"""A bf16 run (--precision bf16) writes every student folder in the run's precision, the pruned student's.

The rule (run_phases.in_precision): a model folder is stored in the dtype the run loads the teacher in, bfloat16
here, whatever the teacher's files hold (the tiny teacher's are float32); the float32 master weights live only in
training and the checkpoints. The run is shaped as the gemma3-270m-tpu preset's (one-shot cut, pruned-CE control).

The same run resumed after its training (its evaluation and student folder removed, as when the TPU demo's first
command stopped there) reloads each phase from its folder and must write the same student and report the very
figures of the uninterrupted run: the figures are those of the saved weights. The phases used to be reloaded in
float32, so the resumed run wrote a float32 student and scored it with programs of its own, to other figures.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest

from recipe_env import RECIPE, TINY_TEACHER, recipe_env

pytestmark = pytest.mark.slow  # recipe runs end to end

BF16 = [*TINY_TEACHER, "--precision", "bf16", "--steps", "4", "--student", "layers=2,mlp=24", "--compression",
        "oneshot", "--control", "pruned-ce", "--calibration-samples", "8", "--eval-prompts", "0",
        "--choice-items", "0", "--eval-batches", "1"]
STUDENTS = ("student", "phases/stage_b", "phases/control")  # the distilled student (folder and phase), the control


def run(output, cache, *extra) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, RECIPE, *BF16, "--output", str(output), "--cache-dir", str(cache), *extra],
                          capture_output=True, text=True, env=recipe_env(cache.parent), timeout=900)
    assert proc.returncode == 0, f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def stored_dtypes(folder) -> set[str]:
    """The dtypes of the tensors in `folder`'s safetensors files, read from their headers."""
    dtypes = set()
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        dtypes |= {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return dtypes


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_teacher_cache):
    """The run's folder after the whole run, and after a resumed run that only evaluated and saved again."""
    base = tmp_path_factory.mktemp("precision")
    whole, resumed = base / "whole", base / "resumed"
    run(whole, tiny_teacher_cache)
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "student")
    (resumed / "phases" / "evaluation.json").unlink()
    proc = run(resumed, tiny_teacher_cache, "--resume")
    assert "[control] finished in an earlier run" in proc.stdout
    return whole, resumed


def test_every_student_folder_is_stored_in_the_pruned_students_bf16(folders):
    for folder in folders:
        for name in STUDENTS:
            assert stored_dtypes(folder / name) == {"BF16"}, (folder.name, name)
        assert json.loads((folder / "student" / "config.json").read_text())["torch_dtype"] == "bfloat16"
        # the evaluated models' own bytes (parameters x their dtype's size): the pruned student's, in bfloat16
        rows = {row["model"]: row for row in json.loads((folder / "results.json").read_text())["rows"]}
        control = next(name for name in rows if "control" in name)
        sizes = {rows[name]["safetensors_bytes"] for name in ("pruned (before distillation)", "distilled student",
                                                              control)}
        assert sizes == {2 * rows["distilled student"]["parameters"]}, (folder.name, sizes)


def test_a_resumed_run_reports_the_figures_of_the_saved_students(folders):
    whole, resumed = (json.loads((folder / "results.json").read_text()) for folder in folders)
    assert resumed["rows"] == whole["rows"]
    assert resumed["sets"] == whole["sets"]
    assert (folders[1] / "student" / "model.safetensors").read_bytes() == \
        (folders[0] / "student" / "model.safetensors").read_bytes()
