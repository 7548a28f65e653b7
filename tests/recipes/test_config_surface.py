"""The recipe's configuration surface: every direct flag checked against the DistillConfig it produces (built
without a model), config files (JSON and YAML) under the flags, --set, --print-config, the resolved config that
repeats a run, --help, and the example configs of recipes/configs/ run end to end at tiny scale."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
CONFIGS = os.path.join(ROOT, "recipes", "configs")
EXAMPLES = ("quick_kd.json", "progressive.json", "attention_feature.yaml")
sys.path.insert(0, ROOT)

from nnx_surgery import distill  # noqa: E402
from nnx_surgery.distill.loop.run_config import Ramp  # noqa: E402
from nnx_surgery.recipes.compress import phase_configs  # noqa: E402
from nnx_surgery.recipes.config import command_line, layering  # noqa: E402
from nnx_surgery.recipes.compress import files, resolution
from nnx_surgery.refusals import RecipeError  # noqa: E402
from recipe_env import TINY_TEACHER, recipe_env  # noqa: E402


def resolve(*flags):
    return resolution.resolve(["--preset", "tiny", *flags])


def main_config(args, num_layers: int = 9) -> distill.DistillConfig:
    """What the recipe's stage B would run after the surgery (no K/V warm-up): the main stages, this phase."""
    stages = phase_configs.main_stages(args, num_layers, args.training.steps)
    return phase_configs.phase_config(args, "stage_b", stages, None, "/unused")


def only_stage(config: distill.DistillConfig) -> distill.Stage:
    assert len(config.stages) == 1
    return config.stages[0]


FLAG_CASES = {
    "temperature ramp": (["--temperature", "3:1"], lambda c: only_stage(c).temperature == Ramp(3.0, 1.0)),
    "temperature": (["--temperature", "2"], lambda c: only_stage(c).temperature == Ramp(2.0, 2.0)),
    "alpha": (["--alpha", "0.25"], lambda c: only_stage(c).weights == distill.LossWeights.mixed(0.25, feature=0.1)),
    "loss jsd": (["--loss", "jsd", "--alpha", "0.5"],
                 lambda c: only_stage(c).weights.active() == {"jsd", "ce", "feature"} and only_stage(c).weights.jsd
                 == 0.5),
    "loss reverse_kl": (["--loss", "reverse_kl", "--alpha", "1"],
                        lambda c: only_stage(c).weights.active() == {"reverse_kl", "feature"}),
    "attention weight": (["--attention-weight", "0.2"], lambda c: only_stage(c).weights.attention == 0.2),
    "feature and cosine": (["--feature-weight", "0.5", "--cosine-weight", "0.3"],
                           lambda c: (only_stage(c).weights.feature, only_stage(c).weights.cosine) == (0.5, 0.3)),
    "top-k": (["--top-k", "16"], lambda c: c.top_k == 16),
    "grad accum": (["--grad-accum", "3"], lambda c: c.grad_accum == 3),
    "weight decay": (["--weight-decay", "0.01"], lambda c: c.optimizer.weight_decay == 0.01),
    "remat": (["--remat", "dots"], lambda c: c.remat == "dots"),
    "remat none": (["--remat", "none"], lambda c: c.remat is None),
    "trainable": (["--trainable", "layers.{6-8}", "--trainable", "*norm*"],
                  lambda c: only_stage(c).trainable == ("layers.{6-8}", "*norm*")),
    "frozen": (["--frozen", "embed_tokens"], lambda c: only_stage(c).frozen == ("embed_tokens",)),
    "learning rate and warm-up": (["--learning-rate", "5e-4", "--warmup-steps", "3"],
                                  lambda c: (only_stage(c).learning_rate, only_stage(c).warmup_steps) == (5e-4, 3)),
    "steps": (["--steps", "17"], lambda c: c.total_steps == 17 and c.eval_every == 4),
    "sizes and precision": (["--batch-size", "6", "--seq-len", "64", "--precision", "bf16", "--seed", "5"],
                            lambda c: (c.batch_size, c.seq_len, c.compute_dtype, c.seed) == (6, 64, "bfloat16", 5)),
    "mesh": (["--mesh", "fsdp=1", "--mesh-devices", "1"], lambda c: (c.mesh, c.mesh_devices) == ("fsdp=1", 1)),
    "feature kind": (["--feature-kind", "pooled"], lambda c: c.loss_options == {"feature": {"kind": "pooled"}}),
    "checkpoint every": (["--checkpoint-every", "7"],
                         lambda c: c.checkpoint.every == 7 and c.checkpoint.directory.endswith("stage_b")),
    "fallbacks": (["--fallback", "switch_to_mse", "--fallback", "sft_then_mix"],
                  lambda c: c.guard.policies == ("switch_to_mse", "sft_then_mix")),
    "targets": (["--stop-when-met"], lambda c: c.targets.stop_when_met is True),
    "oom": (["--no-oom-retry"], lambda c: c.oom.retry is False),
    "logger": (["--logger", "wandb", "--wandb-project", "p"], lambda c: (c.logger, c.wandb_project) == ("wandb", "p")),
    "eval": (["--eval-every", "5", "--eval-batches", "3"], lambda c: (c.eval_every, c.eval_batches) == (5, 3)),
    "on-policy": (["--on-policy", "0.5", "--on-policy-temperature", "0.7", "--on-policy-prompt-len", "32",
                   "--loss", "jsd", "--jsd-beta", "0.2"],
                  lambda c: (c.on_policy.fraction, c.on_policy.temperature, c.on_policy.prompt_len, c.jsd_beta)
                  == (0.5, 0.7, 32, 0.2) and "jsd" in only_stage(c).weights.active()),
    "set": (["--set", "guard.mse_weight=2.5", "--set", "distill.logit_chunk=64", "--set", "oom.sequence=[\"full\"]"],
            lambda c: (c.guard.mse_weight, c.logit_chunk, c.oom.sequence) == (2.5, 64, ("full",))),
    "set a recipe setting": (["--set", "training.steps=13", "--set", "data.seq_len=64"],
                             lambda c: (c.total_steps, c.seq_len) == (13, 64)),
}


@pytest.mark.parametrize("name", sorted(FLAG_CASES))
def test_each_flag_reaches_the_distill_config(name):
    flags, check = FLAG_CASES[name]
    config = main_config(resolve(*flags))
    assert check(config), (name, config)
    default = main_config(resolve())
    assert not check(default) or name in ("remat none",), f"{name}: the default already passes the check"


def test_the_control_phase_never_samples_on_policy():
    """The CE control has no teacher to score the student's samples: its phase turns on-policy off."""
    args = resolve("--on-policy", "1.0")
    control = phase_configs.phase_config(args, "control", [phase_configs.control_stage(args, 10)], None, "/unused")
    assert control.on_policy.fraction == 0.0 and main_config(args).on_policy.fraction == 1.0


def test_student_flag_and_preset_defaults():
    args = resolve("--student", "layers=3,mlp=0.5")
    assert args.student.shape == "layers=3,mlp=0.5" and args.teacher.model is None
    args = resolution.resolve(["--preset", "gemma3-270m"])
    assert (args.student.shape, args.training.frozen, args.training.alpha, args.training.term_weights["feature"]) == \
        ("layers=18,mlp=768,vocab=16384", ("embed_tokens",), 0.5, 0.0)
    assert (args.data.general_mix, args.run.gguf) == (0.5, "q8_0")


def test_the_schedule_flag_selects_progressive_with_its_own_numbers_unless_given():
    config = main_config(resolve("--schedule", "progressive", "--steps", "30", "--frozen", "embed_tokens"))
    assert [s.frozen for s in config.stages] == [("layers.{0-6}", "embed_tokens"), ("layers.{0-3}", "embed_tokens"),
                                                 ("embed_tokens",)]
    assert [s.learning_rate for s in config.stages] == [1e-4, 5e-5, 1e-5]
    assert config.stages[0].weights == distill.LossWeights(kl=0.5, ce=0.5, feature=0.1)  # not the preset's alpha 1
    assert config.stages[0].temperature.start == 3.0 and config.stages[-1].temperature.end == 1.0
    given = main_config(resolve("--schedule", "progressive", "--alpha", "0.7", "--temperature", "2"))
    assert given.stages[0].weights.kl == 0.7 and given.stages[1].temperature == Ramp(2.0, 2.0)
    sft = only_stage(main_config(resolve("--schedule", "sft-then-distil", "--feature-weight", "0")))
    assert sft.weights.ramps == {"kl": Ramp(0.0, 0.5), "ce": Ramp(1.0, 0.5)}


def test_a_config_file_sits_under_the_flags_and_set_wins_over_both(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"alpha": 0.2, "top_k": 4, "steps": 12, "frozen": "embed_tokens",
                                "distill": {"guard": {"mse_weight": 3.0, "policies": ["switch_to_mse"]},
                                            "grad_accum": 2}}))
    args = resolve("--config", str(path), "--top-k", "8", "--set", "guard.mse_weight=5")
    config = main_config(args)
    assert (config.top_k, config.guard.mse_weight, config.grad_accum, config.total_steps) == (8, 5, 2, 12)
    assert only_stage(config).weights.kl == 0.2 and only_stage(config).frozen == ("embed_tokens",)
    assert config.guard.policies == ("switch_to_mse",)


def test_yaml_and_json_give_the_same_settings(tmp_path):
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(CONFIGS, "attention_feature.yaml")) as handle:
        data = yaml.safe_load(handle)
    (tmp_path / "same.json").write_text(json.dumps(data))
    from_yaml = files.saved_config(resolution.resolve(["--config", os.path.join(CONFIGS, "attention_feature.yaml")]))
    assert from_yaml == files.saved_config(resolution.resolve(["--config", str(tmp_path / "same.json")]))
    config = main_config(resolution.resolve(["--config", os.path.join(CONFIGS, "attention_feature.yaml")]), 9)
    assert [s.steps for s in config.stages] == [120, 280]  # fractions 0.3 / 0.7 of steps 400
    assert config.stages[1].weights.ramps["feature"] == Ramp(1.0, 0.1)


@pytest.mark.parametrize("content, flags, culprit", [
    ({"stpes": 3}, [], "stpes"),
    ({"distill": {"batch_size": 4}}, [], "data.batch_size (--batch-size)"),
    ({"distill": {"mesh": "fsdp=2"}}, [], "training.mesh (--mesh)"),
    ({"training": {"stepz": 3}}, [], "training.stepz"),
    ({"trainnig": {"steps": 3}}, [], "trainnig"),
    ({"training": {"steps": 0}}, [], "--steps 0 (training.steps): give from 1 to 2,147,483,647 optimizer steps"),
    ({"training": {"term_weights": {"featur": 1.0}}}, [], "'featur'"),
    ({"distill": {"checkpoint": {"directory": "/x"}}}, [], "--output"),
    ({"distill": {"guard": {"polcies": []}}}, [], "polcies"),
    ({"distill": {"feature_knid": "nmse"}}, [], "feature_knid"),
    ({"distill": {"stages": [{"fraction": 0.5, "steps": 3}]}}, [], "fraction"),
    ({"distill": {"stages": [{"steps": 3}]}}, ["--schedule", "progressive"], "keep one"),
    ({"schedule": "progressive", "schedule_options": {"stages": 4}}, [], "schedule_options"),
    ({}, ["--schedule", "progressive", "--trainable", "layers.1"], "--trainable"),
    ({}, ["--set", "guard.mse_weight"], "KEY=VALUE"),
    ({}, ["--set", "training.steps=\"many\""], "--steps many (training.steps): give an integer"),
    ({}, ["--set", "logit_impl=\"fast\""], "logit_impl"),
    ({}, ["--temperature", "3:0"], "--temperature"),
    ({}, ["--loss", "reverse_kl", "--top-k", "4"], "top_k"),
    ([1, 2], [], "mapping"),
])
def test_bad_settings_are_recipe_errors_naming_the_culprit(tmp_path, content, flags, culprit):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RecipeError) as error:
        resolve("--config", str(path), *flags)
    assert culprit in str(error.value)


def test_unreadable_config_files_are_recipe_errors(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "broken.yaml").write_text("a: [unclosed")
    for name in ("broken.json", "broken.yaml", "missing.json"):
        with pytest.raises(RecipeError, match=name):
            resolve("--config", str(tmp_path / name))


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_resolved_config_repeats_the_settings_exactly(tmp_path, example):
    args = resolution.resolve(["--config", os.path.join(CONFIGS, example), "--grad-accum", "2", "--top-k", "5"])
    saved = files.save_resolved(args, str(tmp_path))
    again = resolution.resolve(["--config", saved])
    assert files.saved_config(again) == files.saved_config(args) == json.load(open(saved))
    assert main_config(again, 12) == main_config(args, 12)


def test_resume_refuses_other_settings_than_the_run_started_with(tmp_path):
    files.save_resolved(resolve("--steps", "8"), str(tmp_path))
    files.save_resolved(resolve("--steps", "8", "--resume"), str(tmp_path))  # the same settings: fine
    with pytest.raises(RecipeError, match=r"\['training.alpha', 'training.steps'\] differ"):
        files.save_resolved(resolve("--steps", "9", "--alpha", "0.5", "--resume"), str(tmp_path))


def test_help_lists_every_knob_with_its_default_and_print_config_needs_no_output():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, RECIPE, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    parser = command_line.build_recipe_parser()
    declared = {item.dest: item for item in layering.every_field()}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.option_strings[0] in text
            item = declared.get(action.dest)
            if item is not None and item.meta.get("saved", True) and item.meta.get("action") != "store_false" \
                    and action.option_strings[0] == item.flag:  # not a shortcut such as --no-scratch
                assert "default" in action.help, action.dest
    for field in dataclasses.fields(distill.DistillConfig):
        if field.name not in layering.MANAGED and field.name != "stages":
            assert f"{field.name} = " in proc.stdout, field.name
    for title in ("Run:", "Teacher:", "Data:", "Training (the stages):", "Shape search", "Evaluation:",
                  "Distillation (the distill section: DistillConfig):"):
        assert title in proc.stdout  # grouped by section
    flags = ["--preset", "tiny", "--schedule", "progressive", "--set", "targets.kl_below=0.05"]
    printed = subprocess.run([sys.executable, RECIPE, *flags, "--print-config"], capture_output=True, text=True,
                             env=env, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == files.saved_config(resolution.resolve(flags))


# ------------------------------------------------------------------------- the examples, end to end at tiny scale
TINY = [*TINY_TEACHER, "--student", "scaled", "--calibration-samples", "8", "--steps", "3", "--kv-warmup", "0",
        "--warmup-steps", "1",  # the examples' warm-ups are for their own --steps (a longer one is refused)
        "--control", "none", "--eval-prompts", "0", "--choice-items", "0", "--eval-batches", "1",
        "--eval-every", "3", "--set", 'compiler_options={"xla_backend_optimization_level": 0}']


# One example also trains the teacher first (--teacher-correction), stopped inside that phase as asked and resumed.
CORRECTION = {"quick_kd.json": ["--teacher-correction", "4", "--teacher-correction-lr", "1e-3"]}


def run_example(example, out, cache, *flags):
    return subprocess.run([sys.executable, RECIPE, "--config", os.path.join(CONFIGS, example), *TINY,
                           *CORRECTION.get(example, []), "--output", str(out), "--cache-dir", str(cache), *flags],
                          capture_output=True, text=True, timeout=600, env=recipe_env(cache.parent))


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory, tiny_teacher_cache):
    """Each example config with the tiny overrides (flags win over the file), sharing one cached tiny teacher:
    {example: (its run folder, the finished run's process)}, and for the teacher-correction example also the
    halted run's process and whether the phase was saved when it stopped, under "halted"."""
    cache = tiny_teacher_cache  # the session's tiny teacher (tests/conftest.py)
    runs = {}
    for example in EXAMPLES:
        out = tmp_path_factory.mktemp(example.split(".")[0])
        if example in CORRECTION:
            halted = run_example(example, out, cache, "--overwrite", "--halt-after", "teacher_correction:2")
            runs["halted"] = halted, (out / "phases" / "teacher_correction").exists()
            proc = run_example(example, out, cache, "--resume")
        else:
            proc = run_example(example, out, cache, "--overwrite")
        assert proc.returncode == 0, f"{example}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        runs[example] = out, proc
    return runs


def _records(out):
    with open(out / "logs" / "stage_b" / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
@pytest.mark.parametrize("example, stage_count, terms", [
    ("quick_kd.json", 1, {"term/kl"}),
    ("progressive.json", 3, {"term/kl", "term/ce"}),
    ("attention_feature.yaml", 2, {"term/ce", "loss/attention", "loss/feature"}),
])
def test_each_example_config_runs_at_tiny_scale(example_runs, example, stage_count, terms):
    out = example_runs[example][0]
    records = _records(out)
    assert sum(1 for r in records if r.get("event") == "stage") == stage_count
    steps = [r for r in records if "event" not in r and not r.get("eval") and "loss" in r]
    assert len(steps) == 3 and terms <= set(steps[-1]) | set(steps[0])
    results = json.load(open(out / "results.json"))
    assert {row["model"] for row in results["rows"]} >= {"teacher", "distilled student"}
    saved = json.load(open(out / "resolved_config.json"))
    assert saved == files.saved_config(resolution.resolve(["--config", os.path.join(CONFIGS, example), *TINY,
                                                           *CORRECTION.get(example, [])]))
    assert files.saved_config(resolution.resolve(["--config", str(out / "resolved_config.json")])) == saved
    assert saved["training"]["steps"] == 3 and saved["distill"]["eval_every"] == 3  # the flags over the file


@pytest.mark.slow
def test_teacher_correction_trains_the_teacher_alone_resumes_and_is_reported(example_runs):
    """--teacher-correction (the quick_kd example's run): the teacher fine-tuned with CE first (halted inside it,
    then resumed), then pruned and teaching; the results show the corrected teacher and the teacher as it was."""
    (halted, phase_saved), (out, resumed) = example_runs["halted"], example_runs["quick_kd.json"]
    assert halted.returncode == 3, halted.stderr[-2000:]
    assert "--resume" in halted.stderr and not phase_saved
    assert "[teacher correction] 4 steps" in resumed.stdout
    history = json.loads((out / "phases" / "teacher_correction" / "history.json").read_text())
    assert len(history["train"]) == 4 and all("kl" not in r or r["kl"] == 0 for r in history["train"])
    results = json.loads((out / "results.json").read_text())
    by = {row["model"]: row for row in results["rows"]}
    assert list(by) == ["teacher", "teacher before correction", "pruned (before distillation)", "distilled student"]
    assert by["teacher"]["parameters"] == by["teacher before correction"]["parameters"]
    assert abs(by["teacher"]["loss"] - by["teacher before correction"]["loss"]) > 1e-4  # the teacher trained
    corrected = json.loads((out / "phases" / "teacher_correction" / "config.json").read_text())
    assert corrected["num_hidden_layers"] == 14  # the whole teacher, not a student
    assert by["teacher before correction"]["kl_to_teacher"] > 0  # another model than the one that taught
    assert "teacher correction" in results["phase_times_s"] and results["teacher_correction"] == 4
