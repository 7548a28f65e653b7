"""The Llama family (Llama, Mistral, Qwen2) against transformers: logits, padding, saving, surgery, generation.

Every checkpoint is made by transformers itself (tests/hf_reference.py) with random weights everywhere, so a
missing bias, a norm in the wrong form, an embedding scaled by mistake or a RoPE kind computed differently shows
up as a logit difference. Float32 logits must agree to 1e-4 of their largest magnitude."""
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from hf_reference import (LLAMA_FAMILIES, assert_clean_loading, hf_logits, load_with_info,  # noqa: E402
                          make_hf_model, sample_ids, save_hf)

from nnx_surgery.surgery import load_pretrained, save_pretrained  # noqa: E402
from nnx_surgery.surgery.pruning.in_memory import apply_plan  # noqa: E402
from nnx_surgery.surgery.modeling.model_config import ConfigError, ModelConfig  # noqa: E402
from nnx_surgery.surgery.planning.student_planner import plan_student  # noqa: E402
from nnx_surgery.surgery.plans.student_spec import StudentSpec  # noqa: E402

IDS = sample_ids(batch=2, length=21)  # longer than the sliding windows (5) and the llama3 context (16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for seed, family in enumerate(LLAMA_FAMILIES):
        model = make_hf_model(family, seed=seed)
        out[family] = (save_hf(model, tmp_path_factory.mktemp(family)), model)
    return out


def _close(got, want, tol=1e-4):
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    folder, reference = checkpoints[family]
    model = load_pretrained(folder)
    _close(np.asarray(model(IDS).logits), hf_logits(reference, IDS))


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_padding_matches_transformers(checkpoints, family):
    folder, reference = checkpoints[family]
    mask = np.ones_like(IDS)
    mask[0, :6] = 0  # left padding on the first row
    want = hf_logits(reference, IDS, attention_mask=mask)
    got = np.asarray(load_pretrained(folder)(IDS, attention_mask=mask).logits)
    _close(got[0, 6:], want[0, 6:])
    _close(got[1], want[1])


def test_family_quirks_are_read(checkpoints):
    configs = {family: ModelConfig.from_file(checkpoints[family][0]) for family in LLAMA_FAMILIES}
    assert configs["llama"].rope["full_attention"].kind == "llama3" and configs["llama"].unties_head
    assert not configs["llama"].scales_embeddings and not configs["llama"].norm_offset
    assert configs["qwen2"].attention_bias and not configs["qwen2"].output_bias
    assert configs["qwen2"].layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert set(configs["mistral"].layer_types) == {"sliding_attention"}
    assert configs["llama_tied"].attention_bias and configs["llama_tied"].output_bias
    assert configs["llama_tied"].tie_word_embeddings


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_saved_model_reloads_in_transformers(checkpoints, family, tmp_path):
    folder, reference = checkpoints[family]
    model = load_pretrained(folder)
    out = save_pretrained(model, tmp_path / "copy")
    reloaded, info = load_with_info(out)
    assert_clean_loading(info)
    _close(hf_logits(reloaded, IDS), hf_logits(reference, IDS), tol=1e-6)
    saved = json.loads((Path(out) / "config.json").read_text())
    assert saved["model_type"] == reference.config.model_type
    assert ModelConfig.from_hf_dict(saved) == ModelConfig.from_file(folder)


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_tied"])
def test_pruned_student_loads_clean_and_matches(checkpoints, family, tmp_path):
    """Fewer layers, a narrower MLP, fewer heads, KV heads merged and hidden channels removed: the student saved
    by the surgery loads in transformers with no missing or unexpected tensor and computes our logits."""
    folder, _ = checkpoints[family]
    teacher = load_pretrained(folder)
    plan = plan_student(teacher, StudentSpec(3, 24, 32, 2, 1), width="magnitude")
    student = apply_plan(teacher, plan)
    out = save_pretrained(student, tmp_path / "student", source=folder)
    reloaded, info = load_with_info(out)
    assert_clean_loading(info)
    _close(hf_logits(reloaded, IDS), np.asarray(student(IDS).logits))


def test_unsupported_llama_configs_are_refused():
    base = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4)
    for bad, words in ((dict(hidden_act="gelu"), "hidden_act"), (dict(mlp_bias=True), "mlp_bias"),
                       (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "yarn")):
        with pytest.raises(ConfigError, match=words):
            ModelConfig.from_hf_dict({**base, **bad})
    assert ModelConfig.from_hf_dict(base).num_key_value_heads == 4  # as transformers defaults it


def test_greedy_generation_matches_transformers(checkpoints):
    import torch

    from nnx_surgery.surgery import generate

    folder, reference = checkpoints["llama"]
    prompts = [[5, 9, 17, 3], [40, 2, 8]]
    got = generate(load_pretrained(folder), prompts, max_new_tokens=12, temperature=0.0)
    for prompt, tokens in zip(prompts, got.tokens):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(tokens)[:len(want)] == want


def test_skip_layers_is_the_identity_for_those_layers(checkpoints):
    model = load_pretrained(checkpoints["llama"][0])
    full = model(IDS[:, :8], capture=("residual",))
    skipped = model(IDS[:, :8], skip_layers=[1], capture=("residual",))
    np.testing.assert_array_equal(np.asarray(skipped.residual[2]), np.asarray(skipped.residual[1]))
    np.testing.assert_array_equal(np.asarray(skipped.residual[1]), np.asarray(full.residual[1]))
    traced = model(IDS[:, :8], skip_layers=jnp.arange(4) == 1)
    np.testing.assert_allclose(np.asarray(traced.logits), np.asarray(skipped.logits), atol=1e-6)


@pytest.mark.slow
def test_the_recipe_compresses_a_llama_teacher(checkpoints, tmp_path):
    """`--teacher` any Llama folder: plan, prune, distil against the CE control, evaluate, save; the student
    loads clean in transformers and computes what the run says it does."""
    import os
    import subprocess
    import shutil

    from hf_reference import save_tiny_tokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(checkpoints["llama"][0], teacher)
    save_tiny_tokenizer(str(teacher))
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):  # a learnable text: lines of increasing tokens
        starts = rng.integers(4, 80, 300)
        (corpus / f"doc{i}.txt").write_text("\n".join(" ".join(f"t{s + k}" for k in range(6)) for s in starts))
    recipe = Path(__file__).parents[3] / "recipes" / "gemma_7b_to_2b.py"
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(recipe), "--teacher", str(teacher), "--student",
                           "layers=2,mlp=0.5,heads=2,kv_heads=1", "--data", str(corpus), "--output", str(out),
                           "--steps", "6", "--batch-size", "2", "--seq-len", "16", "--calibration-samples", "4",
                           "--eval-prompts", "2", "--new-tokens", "4", "--choice-items", "4", "--control", "none",
                           # one prune and one distillation (staged compression is family-independent: test_recipe)
                           "--compression", "oneshot",
                           # held-out sets of 1,024 tokens and 2 batches per in-training evaluation (the default
                           # preset's are 16,384 and 64 at this batch of 2 x 16 tokens)
                           "--eval-tokens", "1024", "--eval-batches", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    student_dir = out / "student"
    saved = json.loads((student_dir / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["num_hidden_layers"] == 2
    reloaded, info = load_with_info(str(student_dir))
    assert_clean_loading(info)
    _close(hf_logits(reloaded, IDS), np.asarray(load_pretrained(str(student_dir), dtype="float32")(IDS).logits))
    rows = {row["model"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    assert {"teacher", "pruned (before distillation)", "distilled student"} <= set(rows)
    assert np.isfinite(rows["distilled student"]["loss"]) and rows["distilled student"]["parameters"] < \
        rows["teacher"]["parameters"]
