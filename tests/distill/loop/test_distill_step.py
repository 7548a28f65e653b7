"""The train step's gradient paths against plain autodiff: the tied-embedding fold, a frozen embedding, an untied
head, fused blocks; and the Adam update computed from the new moments against optax."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import LossWeights, Stage
from nnx_surgery.distill.loop.freeze import path_string, split_trainable
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model
from distill_fixtures import FAST_COMPILE, LENGTH, VOCAB, student_from, tiny_config, tiny_teacher

HYPER = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, ce=0.5), temperature=2.0), 0, 0.0)
COUNTS = {"tokens": jnp.float32(2 * (LENGTH - 1)), "positions": jnp.float32(2 * LENGTH)}


def _batch(seed=0):
    ids = np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH)).astype(np.int32)
    return {"input_ids": jnp.asarray(ids)}


def _gradients(student, teacher, *, frozen=None, dtype=jnp.float32, **settings_changes):
    """(fold engaged?, loss, {path: gradient}) of one micro-batch through `make_grad_fn`."""
    graph, trainable, rest = split_trainable(student, None, frozen)
    teacher_graph, teacher_state = nnx.split(teacher)
    logit = LogitLossSettings(kl=True, ce=True, chunk=8, block=settings_changes.pop("block", None))
    settings = step_lib.StepSettings(logit=logit, compute_dtype=dtype, **settings_changes)
    params = {"student": trainable, "proj": {}}
    fold = step_lib._embedding_fold(graph, params, rest, settings)
    grad_fn = step_lib.make_grad_fn(graph, teacher_graph, settings)
    run = jax.jit(grad_fn, compiler_options=FAST_COMPILE)
    (loss, _), grads = run(params, rest, teacher_state, _batch(), COUNTS, HYPER)
    return fold, float(loss), {path_string(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads["student"])}


def _assert_same(got, want, rtol=1e-4, atol=1e-6):
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=rtol, atol=atol, err_msg=path)


@pytest.fixture(scope="module")
def models():
    return tiny_teacher(), student_from(tiny_teacher())


def test_tied_trainable_embedding_fold_equals_autodiff(models):
    teacher, student = models
    folded, loss, grads = _gradients(student, teacher)
    plain, plain_loss, want = _gradients(student, teacher, fold_embedding=False)
    ref, ref_loss, reference = _gradients(student, teacher, logit_impl="reference")
    assert folded and not plain and not ref
    assert loss == pytest.approx(plain_loss, rel=1e-6) == ref_loss
    _assert_same(grads, want)
    _assert_same(grads, reference)
    # both the head's and the lookup's contributions are in the folded gradient: rows of tokens that appear only
    # as inputs (never as next-token targets) still differ from the head-only gradient
    assert float(np.abs(grads["embed_tokens"]).max()) > 1e-3


def test_fold_of_a_tied_model_without_embedding_scale_equals_autodiff():
    """A Llama-style tied student (`config.scales_embeddings` False: rows are not multiplied by sqrt(D)): the fold
    adds the lookup gradient unscaled, as autodiff does."""
    config = ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    assert not config.scales_embeddings
    teacher, student = create_model(config, seed=0), create_model(config, seed=1)
    folded, loss, grads = _gradients(student, teacher)
    plain, plain_loss, want = _gradients(student, teacher, fold_embedding=False)
    assert folded and not plain and loss == pytest.approx(plain_loss, rel=1e-6)
    _assert_same(grads, want)


def test_fold_with_bfloat16_compute_equals_bfloat16_autodiff(models):
    """With bf16 compute the folded head gradient stays float32 (autodiff rounds it to bf16 once), so only the
    embedding's gradient differs, by bf16 rounding."""
    teacher, student = models
    folded, _, grads = _gradients(student, teacher, dtype=jnp.bfloat16)
    _, _, want = _gradients(student, teacher, dtype=jnp.bfloat16, fold_embedding=False)
    assert folded and all(g.dtype == np.float32 for g in grads.values())
    _assert_same({k: v for k, v in grads.items() if k != "embed_tokens"},
                 {k: v for k, v in want.items() if k != "embed_tokens"}, rtol=1e-6, atol=0)
    scale = float(np.abs(want["embed_tokens"]).max())
    np.testing.assert_allclose(grads["embed_tokens"], want["embed_tokens"], rtol=0, atol=1e-2 * scale)


def test_frozen_embedding_and_untied_head_take_the_autodiff_path(models):
    teacher, student = models
    folded, _, grads = _gradients(student, teacher, frozen=["embed_tokens"], block=16)
    _, _, reference = _gradients(student, teacher, frozen=["embed_tokens"], logit_impl="reference")
    assert not folded and "embed_tokens" not in grads
    _assert_same(grads, reference)

    untied = create_model(tiny_config(2).replace(tie_word_embeddings=False), seed=4)
    state = nnx.state(untied)
    nnx.update(untied, jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, state))
    folded, _, grads = _gradients(untied, teacher, block=32)
    _, _, reference = _gradients(untied, teacher, logit_impl="reference")
    assert not folded and {"embed_tokens", "lm_head"} <= set(grads)
    _assert_same(grads, reference)
    assert float(np.abs(grads["embed_tokens"]).max()) > 1e-4 and float(np.abs(grads["lm_head"]).max()) > 1e-3


def test_adam_direction_from_the_new_moments_equals_optax():
    settings = step_lib.AdamSettings(b1=0.8, b2=0.95, eps=1e-6)
    adam = settings.transform()
    keys = jax.random.split(jax.random.key(1), 3)
    params = {"w": jax.random.normal(keys[0], (5, 3)), "b": jnp.zeros(3)}
    state = adam.init(params)
    for key in keys[1:]:  # two updates: the bias corrections differ per step
        grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
        want, state = adam.update(grads, state, params)
        got = settings.direction(state)
        for name in params:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_global_norm_equals_optax():
    tree = {"a": jnp.arange(12.0).reshape(3, 4), "b": jnp.asarray([3.0, -4.0])}
    assert float(step_lib._global_norm(tree)) == pytest.approx(float(optax.global_norm(tree)), rel=1e-6)


def _matmul_operand_dtypes(jaxpr) -> list[tuple[str, str, int]]:
    """(lhs dtype, rhs dtype, contracted size) of every dot_general in `jaxpr` and its sub-jaxprs (scan, jit,
    custom_vjp, cond bodies)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (contract, _), _ = eqn.params["dimension_numbers"]
            found.append((str(lhs.dtype), str(rhs.dtype), int(np.prod([lhs.shape[i] for i in contract]))))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_matmul_operand_dtypes(inner))
    return found


def test_bfloat16_step_runs_every_matmul_on_bfloat16_operands():
    """With bf16 compute the whole gradient step, the fused loss's two head-gradient matmuls included, multiplies
    bf16 operands (accumulating in float32 where it matters). A float32 cotangent meeting a bf16 weight makes XLA
    upcast both: a float32 matmul, at TF32 rate at best on a GPU, over twice the bytes."""
    teacher = tiny_teacher(dtype=jnp.bfloat16)
    graph, trainable, rest = split_trainable(student_from(tiny_teacher()), None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    for block in (None, 16):  # one block (head gradient deferred to the backward pass), and a (V, D) accumulator
        settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8, block=block),
                                         compute_dtype=jnp.bfloat16)
        grad_fn = step_lib.make_grad_fn(graph, teacher_graph, settings)
        jaxpr = jax.make_jaxpr(grad_fn)({"student": trainable}, rest, teacher_state, _batch(), COUNTS, HYPER)
        dots = [d for d in _matmul_operand_dtypes(jaxpr.jaxpr) if d[2] > 1]  # size 1: the soft-cap probe
        assert len(dots) > 20
        assert {d[:2] for d in dots} == {("bfloat16", "bfloat16")}, [d for d in dots if "float32" in d[:2]]
