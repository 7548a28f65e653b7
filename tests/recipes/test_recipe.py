"""The 7B -> 2B recipe end to end at test scale (tiny preset, small step counts), offline.

One uninterrupted run; the student folder must load cleanly in transformers with the NNX student's logits. The same
run again in another folder, stopped as asked (--halt-after), then SIGKILLed at seeded random points of its
distillation and resumed each time (the soak, tests/soak.py), must end with the uninterrupted run's student bit for
bit (CPU): every tensor of model.safetensors and every loss of the rows both runs have.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from nnx_surgery import surgery

import soak
from hf_reference import assert_clean_loading, hf_logits, load_with_info
from recipe_env import TINY_TEACHER, recipe_env
from recipe_env import RECIPE

pytestmark = pytest.mark.slow  # recipe runs end to end

SMALL = [*TINY_TEACHER, "--steps", "24", "--calibration-samples", "8",
         # the suite's generations and multiple choice still run, for fewer prompts and items than the preset's
         # (8 x 48 tokens, 32 items, for each of four models); fewer held-out batches during training
         "--eval-prompts", "2", "--new-tokens", "8", "--choice-items", "4", "--eval-batches", "4"]
# No --checkpoint-every: every run checkpoints at each phase's start and end and where --halt-after stops it (a
# save costs about a second of CPU). Runs that compare losses with the full run's: no generations or multiple choice.
QUIET = ["--eval-prompts", "0", "--choice-items", "0"]
# The soaked run: checkpoints every other step (the marks its kills wait on), no control (the rows compared are the
# ones both runs have). Its programs are the full run's, so it loads them from the session's compilation cache.
SOAK_CHECKPOINT_EVERY = 2
SOAK = [*QUIET, "--control", "none", "--checkpoint-every", str(SOAK_CHECKPOINT_EVERY)]
STAGE_A_STEPS, STAGE_B_STEPS = 7, 17  # --steps 24 at the default --stage-a-fraction 0.3


def recipe_command(output, cache, *extra) -> list[str]:
    return [sys.executable, RECIPE, *SMALL, "--output", str(output), "--cache-dir", str(cache), *extra]


def run_recipe(output, cache, *extra, check=True):
    """The recipe at test scale; `cache` (the tiny teacher's) lies in the session's base temporary folder."""
    proc = subprocess.run(recipe_command(output, cache, *extra), capture_output=True, text=True,
                          env=recipe_env(cache.parent), timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# one offline lm-eval task on two documents: every model scored through the backend, in memory
FULL_EXTRA = ["--eval-tasks", "nnx_stdlib_next_line", "--eval-tasks-limit", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_teacher_cache):
    base = tmp_path_factory.mktemp("recipe")
    cache = tiny_teacher_cache  # the session's tiny teacher (tests/conftest.py)
    return base, run_recipe(base / "full", cache, *FULL_EXTRA), cache


def test_student_folder_is_complete_and_loads_in_transformers(runs):
    base = runs[0]
    student = base / "full" / "student"
    names = set(os.listdir(student))
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "plan.json", "plan_stage_a.json", "results.json", "README.md"):
        assert required in names, f"{required} missing from {sorted(names)}"
    config = json.loads((student / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"]) == (9, 32, 256, 2, 1)
    model, info = load_with_info(str(student))
    assert_clean_loading(info)

    import jax.numpy as jnp
    from nnx_surgery import surgery

    ids = np.random.default_rng(0).integers(0, 260, (2, 20)).astype(np.int32)
    ours = np.asarray(surgery.load_pretrained(str(student), dtype="float32")(jnp.asarray(ids)).logits)
    assert np.abs(ours - hf_logits(model, ids)).max() <= 1e-4
    card = (student / "README.md").read_text()
    assert "base_model" not in card.split("---")[1] or "tiny-teacher" not in card  # local teacher: no Hub link
    assert "held-out loss" in card.lower()


def test_results_table_compares_all_four_models(runs):
    base, full = runs[0], runs[1]
    results = json.loads((base / "full" / "results.json").read_text())
    names = [row["model"] for row in results["rows"]]
    assert names == ["teacher", "pruned (before distillation)", "distilled student", "scratch student (same shape)"]
    by = {row["model"]: row for row in results["rows"]}
    assert by["distilled student"]["tokens"] == by["scratch student (same shape)"]["tokens"] == 24 * 4 * 32
    assert all(np.isfinite(row["loss"]) and row["perplexity"] > 1 for row in results["rows"])
    # Distillation must improve on the pruned starting point.
    assert by["distilled student"]["loss"] < by["pruned (before distillation)"]["loss"]
    assert "| distilled student |" in full.stdout
    # judged on three held-out sets: in-domain (the corpus's held-out files), general (held-out pydoc topics) and
    # far-domain (prose from files no training text comes from)
    assert set(results["sets"]) == {"in-domain", "general", "far-domain"}
    for name, report in results["sets"].items():
        assert report["tokens"] >= 1000, (name, report["tokens"])
        pairs = {(c["a"], c["b"]): c for c in report["comparisons"]}
        versus = pairs[("distilled student", "scratch student (same shape)")]["ce"]
        key = {"in-domain": "loss", "general": "general_loss", "far-domain": "far_loss"}[name]
        gap = by["distilled student"][key] - by["scratch student (same shape)"][key]
        assert versus["difference"] == pytest.approx(gap, abs=1e-9)
        if report["documents"] >= 2:  # the test corpus holds out one module: no interval in-domain
            assert versus["low"] <= gap <= versus["high"]
        else:
            assert versus["low"] is None and "no interval" in full.stdout
    for name, prefix in (("general", "general"), ("far-domain", "far")):
        held = results["sets"][name]
        assert held["documents"] >= 16
        for row in results["rows"]:
            assert 0 < row[f"{prefix}_loss"] < 10 and row[f"{prefix}_loss_per_byte"] == pytest.approx(
                row[f"{prefix}_loss"] * held["tokens"] / held["bytes"])
        assert "kl_to_teacher" not in by["teacher"] and by["distilled student"][f"{prefix}_kl"] > 0
    assert "General held-out set:" in full.stdout and "Far-domain held-out set:" in full.stdout
    assert "95% interval" in full.stdout and "far-domain CE" in full.stdout
    assert "Wall time: teacher and data" in full.stdout and "evaluation" in results["phase_times_s"]
    reads = results["corpus_reads"]  # how often the distillation read its text: printed and recorded
    assert list(reads) == ["corpus"] and reads["corpus"]["tokens_read"] > 0 and reads["corpus"]["reads"] > 0
    assert "[data] the distillation read each source of its text (the control the same rows): corpus " in full.stdout
    assert "Text read by the distillation (and the control): corpus " in full.stdout
    refits = results["mlp_refit"]  # stage A narrows every MLP: refitted to the teacher's before it trains
    plan_a = surgery.Plan.load(base / "full" / "student" / "plan_stage_a.json")
    narrowed = [s for s, kept in enumerate(plan_a.kept_mlp) if len(kept) < plan_a.teacher_config.intermediate_size]
    assert narrowed and [layer["layer"] for layer in refits["stage_a"]["layers"]] == narrowed
    assert all(layer["after"] < layer["before"] for refit in refits.values() for layer in refit["layers"])
    assert "[surgery] MLP refit:" in full.stdout
    assert "[eval general]" in full.stdout  # progress while the evaluation runs
    for png in ("training_curves.png", "layer_importance.png"):
        assert (base / "full" / png).stat().st_size > 1000
    # --eval-tasks: every model, in memory, on the lm-eval task, with a standard error; in results.md too
    assert results["lm_eval"]["tasks"] == ["nnx_stdlib_next_line"] and list(results["lm_eval"]["scores"]) == names
    assert list(results["lm_eval"]["seconds"]) == names  # each model's scoring timed
    for row in results["rows"]:
        accuracy = row["lm_eval"]["nnx_stdlib_next_line"]["acc"]
        assert accuracy["value"] in (0.0, 0.5, 1.0) and accuracy["stderr"] is not None
    assert "nnx_stdlib_next_line acc" in (base / "full" / "results.md").read_text()


def test_the_scratch_control_reads_stage_a_and_stage_b_batches_in_their_order(runs):
    """Staged compression: stage B reads on in stage A's stream, and the control reads that whole sequence; it
    starts from new weights by design, which results.md says instead of claiming a same start."""
    base, full = runs[0], runs[1]
    pairing = json.loads((base / "full" / "results.json").read_text())["pairing"]
    logged = {phase: json.loads((base / "full" / "phases" / phase / "history.json").read_text())
              for phase in ("stage_a", "stage_b", "control")}
    sequence = [r["batch_digest"] for phase in ("stage_a", "stage_b") for r in logged[phase]["train"]]
    assert len(sequence) == STAGE_A_STEPS + STAGE_B_STEPS
    assert [r["batch_digest"] for r in logged["control"]["train"]] == sequence
    assert pairing["distillation"]["phases"] == ["stage_a", "stage_b"]
    assert pairing["batches"]["same"] and pairing["same_start"] is None
    assert logged["control"]["start"]["data"] == logged["stage_a"]["start"]["data"]
    assert logged["stage_b"]["start"]["data"] == logged["stage_a"]["data_state"]  # B continued A's stream
    assert logged["control"]["start"]["weights"] != logged["stage_b"]["start"]["weights"]
    assert "same batches, same order" in full.stdout and "other weights by design" in full.stdout


def test_halted_then_killed_and_resumed_run_ends_with_the_full_runs_student(runs, tmp_path):
    base, _, cache = runs
    soaked = tmp_path / "soaked"
    started = time.monotonic()
    halted = run_recipe(soaked, cache, *SOAK, "--halt-after", "stage_a:1", check=False)
    assert halted.returncode == 3, halted.stderr[-2000:]
    assert "--resume" in halted.stderr
    env = recipe_env(cache.parent, PYTHONUNBUFFERED="1")

    def resume() -> subprocess.Popen:
        return subprocess.Popen(recipe_command(soaked, cache, *SOAK, "--resume"), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    run_marks, gap = soak.marks(STAGE_A_STEPS, STAGE_B_STEPS, every=SOAK_CHECKPOINT_EVERY)
    report, last = soak.soak(resume, soaked, run_marks, gap, int(os.environ.get("SOAK_SEED", "12")))
    print(f"soak: {time.monotonic() - started:.0f} s in all", flush=True)
    assert "finished in an earlier run" in last, report  # stage A was not redone

    from safetensors.numpy import load_file

    want, got = (load_file(str(folder / "student" / "model.safetensors")) for folder in (base / "full", soaked))
    assert sorted(got) == sorted(want), report
    differing = [name for name in want if not np.array_equal(want[name], got[name])]
    assert not differing, f"tensors differ after the kills: {differing[:6]}\n{report}"
    full_results, soaked_results = (json.loads((folder / "results.json").read_text()) for folder in (base / "full", soaked))
    assert soaked_results["final_losses"] == full_results["final_losses"], report
    losses = [(r["model"], r["loss"], r["perplexity"], r["general_loss"]) for r in full_results["rows"]]
    assert [(r["model"], r["loss"], r["perplexity"], r["general_loss"]) for r in soaked_results["rows"]] == \
        [row for row in losses if row[0] != "scratch student (same shape)"], report
    # every command's phases counted: the halted one, the killed ones and the last
    commands = json.loads((soaked / "phase_times.json").read_text())["commands"]
    assert soaked_results["commands"] == len(commands) >= 2, commands
    assert "teacher and data" in commands[0]["laps"] and commands[0]["unfinished_s"] > 0, commands  # halted in A
    assert soaked_results["wall_time_s"] == pytest.approx(sum(c["wall_s"] for c in commands), abs=60), commands


def test_refuses_to_overwrite_an_earlier_run_without_resume(runs, tmp_path):
    base = runs[0]
    proc = run_recipe(base / "full", runs[2], "--no-scratch", check=False)
    assert proc.returncode != 0
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr


def test_dry_run_prints_shapes_memory_and_plan(runs):
    base = runs[0]
    proc = run_recipe(base / "dry", runs[2], "--dry-run", "--mesh", "fsdp=1,tp=1")
    out = proc.stdout
    assert "layers" in out and "KV heads" in out and "memory per device" in out
    assert "plan:" in out and "block" in out.lower()  # the cached teacher gives a data-free plan table
    assert not (base / "dry").exists()  # a dry run writes nothing, not even the run folder


def test_push_to_hub_flag_publishes_the_student_privately(runs):
    """`--push-to-hub` on a finished run (phases reload from disk) against the local fake Hub, real client."""
    from fake_hub import FakeHub

    base = runs[0]
    rows_before = json.loads((base / "full" / "results.json").read_text())["rows"]
    token = "hf_recipeTestToken0123456789abcdef"
    with FakeHub({token: ("alice", [])}, lifetime_s=600) as hub:
        env = recipe_env(runs[2].parent, {k: v for k, v in os.environ.items()
                                          if not k.startswith(("HF_", "HUGGING_FACE_"))},
                         HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_TOKEN=token, HF_HOME=str(base / "hf_home"),
                         HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.run([sys.executable, RECIPE, *SMALL, "--output", str(base / "full"), "--cache-dir",
                               str(runs[2]), *FULL_EXTRA, "--resume", "--push-to-hub", "alice/tiny-2b-student"],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert token not in proc.stdout + proc.stderr
        # every model was finished, so the evaluation is read back (phases/evaluation.json), not spent again
        assert "[eval] finished in an earlier run" in proc.stdout and "models on the held-out sets" not in proc.stdout
        assert json.loads((base / "full" / "results.json").read_text())["rows"] == rows_before
        repo = hub.repos["alice/tiny-2b-student"]
        assert repo.private
        tree = repo.commits[repo.branches["main"]]
        local = base / "full" / "student"
        for name in ("config.json", "model.safetensors", "plan.json", "README.md", "tokenizer.json"):
            assert hub.file_content(tree[name]) == (local / name).read_bytes(), name
