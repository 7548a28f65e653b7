"""Tunix (DPO, GRPO, its sampler) on our models through `surgery.modeling.tunix`: logits through the adapter equal ours,
Tunix's sampler decodes over our KV cache exactly as `surgery.generate` does (which test_generate ties to
transformers), and a pruned student trained by Tunix's DPOTrainer and GRPOLearner comes back with `from_tunix`
and saves as an HF folder transformers loads.

CI installs the `tunix` extra (Tunix itself with `pip install --no-deps google-tunix==0.1.7`: its wheel pins
safetensors<0.8); without it these tests are skipped."""
from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

pytest.importorskip("tunix", reason="the tunix extra is not installed (see surgery.modeling.tunix.INSTALL_HINT)")
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rl  # noqa: E402
from tunix.rl.grpo import grpo_learner as grpo  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.sft.dpo import dpo_trainer as dpo  # noqa: E402

from nnx_surgery import distill  # noqa: E402
from nnx_surgery import surgery  # noqa: E402
from hf_reference import (assert_clean_loading, hf_logits, load_with_info, make_hf_model,  # noqa: E402
                          save_tiny_tokenizer)
from nnx_surgery.surgery.modeling.generation import generate  # noqa: E402
from nnx_surgery.surgery.modeling.tunix import (INSTALL_HINT, from_tunix, require_tunix, to_tunix, tunix_sampler)  # noqa: E402

# 10 tokens with BOS: past the window (5). Chosen so that no pad id (0) is generated before the end: Tunix's
# sampler masks every pad-id token out of later steps (its own models do too), transformers does not.
PROMPTS = {"gemma3_text": ["t5 t9 t13 t20 t7 t8 t30 t11 t64", "t40 t41 t17"],
           "llama": ["t5 t9 t13 t20 t7 t8 t30 t11 t64", "t40 t41 t18"]}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (our model, folder with a word-level tokenizer): Gemma 3 (sliding and global layers, window 5),
    Llama (GQA, llama3 RoPE) and Mistral (every layer sliding); untied heads, so greedy continuations vary."""
    made = {}
    for seed, family in enumerate(("gemma3_text", "llama", "mistral")):
        folder = str(tmp_path_factory.mktemp(family))
        make_hf_model(family, seed=seed, tie_word_embeddings=False).save_pretrained(folder)
        save_tiny_tokenizer(folder)
        made[family] = (surgery.load_pretrained(folder), folder)
    return made


@pytest.fixture(scope="module")
def pruned(tiny):
    """A Gemma 3 teacher and a surgery plan for a pruned student (3 layers, hidden 24, MLP 32, MQA)."""
    teacher, folder = tiny["gemma3_text"]
    calibration = np.random.default_rng(0).integers(4, 96, (2, 16)).astype(np.int32)
    plan = surgery.plan_student(teacher, surgery.StudentSpec(3, 24, 32, 2, 1), calibration=calibration)
    return teacher, plan, folder


def _params(model) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _saved_logits_match(model, folder, out_dir) -> None:
    """`model` saved as an HF folder loads cleanly in transformers, with logits equal to ours."""
    surgery.save_pretrained(model, out_dir, source=folder)
    reference, info = load_with_info(str(out_dir))
    assert_clean_loading(info)
    ids = np.random.default_rng(3).integers(4, 96, (2, 11)).astype(np.int32)
    want = hf_logits(reference, ids)
    np.testing.assert_allclose(np.asarray(model(ids).logits), want, atol=1e-4 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_training_call_logits_equal_ours(tiny, family):
    """Tunix's training call: (B, T, T) causal mask over real tokens, positions from the mask, cache None."""
    model, _ = tiny[family]
    ids = np.random.default_rng(1).integers(4, 96, (2, 13)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :4] = 0  # left padding, as DPO's prompts have
    mask[1, 10:] = 0  # right padding, as its completions have
    positions = common.build_positions_from_mask(jnp.asarray(mask))
    logits, cache = to_tunix(model)(jnp.asarray(ids), positions, None, common.make_causal_attn_mask(mask))
    want = np.asarray(model(ids, attention_mask=mask).logits)
    assert cache is None and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits)[0, 4:], want[0, 4:], atol=1e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[1, :10], want[1, :10], atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_sampler_greedy_equals_generate(tiny, family):
    """Tunix's Sampler (left-padded prefill, then one-token decode over the adapter's KV cache, past the sliding
    window) picks our generate's tokens, and its per-step logits equal our cache-free forward's."""
    model, folder = tiny[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    sampler = tunix_sampler(to_tunix(model), tokenizer, cache_size=32)
    prompts = PROMPTS[family]
    out = sampler(prompts, max_generation_steps=NEW_TOKENS, eos_tokens=[1], temperature=0.0, return_logits=True)
    rows = [[tokenizer.bos_token_id] + tokenizer.encode(p) for p in prompts]
    ours = generate(model, rows, max_new_tokens=NEW_TOKENS, stop=[1]).tokens
    assert all(len(set(t)) >= 3 and 0 not in t[:-1] for t in ours), ours  # varied, no pad id before the end
    # Tunix leaves the stop token out; ours keeps it, as transformers does
    assert [list(map(int, t)) for t in out.tokens] == [t[:-1] if t[-1] == 1 else t for t in ours]
    for row, new, step_logits in zip(rows, ours, out.logits):
        full = np.asarray(model(np.asarray([row + new[:-1]], np.int32)).logits)[0, len(row) - 1:]
        full = full[:len(step_logits)]
        np.testing.assert_allclose(np.asarray(step_logits), full, atol=1e-5 * np.abs(full).max(), rtol=0)


def test_sampler_decodes_every_layer_sliding(tiny):
    """Mistral: every layer a ring buffer of the window (5) in the adapter's cache, the cache's length read from
    the mask. Pad ids are forbidden so that Tunix's masking of them plays no part; each step's logits equal our
    cache-free forward over the tokens the sampler chose, and each choice is that forward's argmax."""
    model, folder = tiny["mistral"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    out = tunix_sampler(to_tunix(model), tokenizer, cache_size=32)(
        PROMPTS["llama"], max_generation_steps=NEW_TOKENS, eos_tokens=[1], temperature=0.0, return_logits=True,
        forbidden_tokens=[0])
    for prompt, new, step_logits in zip(PROMPTS["llama"], out.tokens, out.logits):
        row, new = [tokenizer.bos_token_id] + tokenizer.encode(prompt), [int(t) for t in new]
        assert len(new) == NEW_TOKENS and len(set(new)) >= 3
        full = np.asarray(model(np.asarray([row + new], np.int32)).logits)[0, len(row) - 1:-1, 1:]
        got = np.asarray(step_logits)[:, 1:]  # token 0 is forbidden (-inf in the sampler's logits)
        np.testing.assert_allclose(got, full, atol=1e-5 * np.abs(full).max(), rtol=0)
        assert new == list(np.argmax(full, axis=-1) + 1)


def test_dpo_trains_a_pruned_student(pruned, tmp_path):
    teacher, plan, folder = pruned
    student = surgery.apply_plan(teacher, plan)
    before = _params(student)
    rng = np.random.default_rng(2)

    def pair() -> dpo.TrainingInput:
        prompt, chosen, rejected = (rng.integers(4, 96, (2, n)).astype(np.int32) for n in (6, 5, 5))
        prompt_mask, chosen_mask = np.ones_like(prompt), np.ones_like(chosen)
        prompt[0, :2] = prompt_mask[0, :2] = 0  # left-padded prompt
        chosen[1, 3:] = chosen_mask[1, 3:] = 0  # right-padded response
        return dpo.TrainingInput(prompt_ids=prompt, prompt_mask=prompt_mask, chosen_ids=chosen,
                                 chosen_mask=chosen_mask, rejected_ids=rejected, rejected_mask=np.ones_like(rejected))

    trainer = dpo.DPOTrainer(to_tunix(student), to_tunix(nnx.clone(student)), optax.adamw(1e-2),
                             dpo.DPOTrainingConfig(eval_every_n_steps=100, max_steps=3, beta=0.1))
    trainer.train([pair() for _ in range(3)])
    losses = np.asarray(trainer.metrics_logger.get_metric_history("", "loss", "train"))
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert abs(losses[0] - math.log(2)) < 1e-5  # policy == reference at the first step: -log sigmoid(0)
    trained = from_tunix(trainer.model)
    assert trained is student  # the adapter shares the student's parameters
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(before, _params(trained)))
    _saved_logits_match(trained, folder, tmp_path / "dpo-student")


@pytest.mark.slow
def test_grpo_trains_a_pruned_student(pruned, tmp_path):
    teacher, plan, folder = pruned
    student = surgery.apply_plan(teacher, plan)
    before = _params(student)
    mesh = distill.make_mesh("fsdp=1,tp=1", devices=1)  # not the model's (unsharded): Tunix re-creates the model
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=100,
                                            max_steps=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=16,
                                                  temperature=0.9, top_p=1.0, seed=0, eos_tokens=[1]))
    cluster = rl.RLCluster(actor=to_tunix(student), reference=to_tunix(nnx.clone(student)),
                           tokenizer=transformers.AutoTokenizer.from_pretrained(folder), cluster_config=config)

    def reward(prompts, completions, **_):
        return [float(c.split().count("t7")) for c in completions]

    learner = grpo.GRPOLearner(rl_cluster=cluster, reward_fns=reward,
                               algo_config=grpo.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04))
    learner.train([{"prompts": np.array(["t5 t9 t13", "t40 t41 t7"])}] * 2)
    losses = np.asarray(cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train"))
    assert len(losses) == 2 and np.all(np.isfinite(losses))
    trained = from_tunix(cluster.actor_trainer.model)
    assert trained is not student  # re-created on the actor's mesh: the object passed in kept its weights
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(student)))
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(before, _params(trained)))
    _saved_logits_match(trained, folder, tmp_path / "grpo-student")


def test_misuse_is_explained(tiny, monkeypatch):
    model, _ = tiny["llama"]
    with pytest.raises(TypeError, match="surgery CausalLM"):
        to_tunix(to_tunix(model))
    with pytest.raises(TypeError, match="actor_trainer.model"):
        from_tunix(model)
    policy = to_tunix(model)
    with pytest.raises(ValueError, match="attention_mask"):
        policy(jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), policy.init_cache(1, 8), None)
    monkeypatch.setitem(sys.modules, "tunix", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match="--no-deps google-tunix==0.1.7") as error:
        require_tunix()
    assert INSTALL_HINT in str(error.value)
