"""The two-pass, vocabulary-sliced logit loss (nnx_surgery/distill/losses/two_pass.py): its loss, metrics and
gradients equal autodiff of the plain loss on full logits (and the fused loss), with soft-capped logits, a
temperature, CE, a vocabulary that the slices do not divide, a frozen head, no teacher and bfloat16 compute; its
compiled temporaries hold neither a (V, D) float32 accumulator nor a (rows, V) block; settings it does not
compute are refused; a train step with logit_impl="two_pass" gives the fused step's loss and gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss, reference_logit_loss
from nnx_surgery.distill.losses.two_pass import two_pass_logit_loss

B, T, D, V = 2, 7, 16, 37
COEFFS = {"temperature": 2.0, "kl": 1.0, "reverse_kl": 0.0, "jsd": 0.0, "ce": 0.5}


def capped(cap):
    return lambda h, w: cap * jnp.tanh(jnp.einsum("...D,VD->...V", h, w.astype(h.dtype),
                                                  preferred_element_type=jnp.float32) / cap)


STUDENT, TEACHER = capped(30.0), capped(50.0)


def inputs(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 6)
    h_s = jax.random.normal(keys[0], (B, T, D), dtype) * 2
    head_s = jax.random.normal(keys[1], (V, D), jnp.float32)
    h_t = jax.random.normal(keys[2], (B, T, 24), dtype) * 2
    head_t = jax.random.normal(keys[3], (V, 24), jnp.float32)
    labels = jax.random.randint(keys[4], (B, T), 0, V)
    weights = jax.random.uniform(keys[5], (B, T)) * (jnp.arange(T) < T - 1) / (B * (T - 1))
    return h_s, head_s, h_t, head_t, labels, weights


def loss_and_grads(kind, spec, args, coeffs=COEFFS, argnums=(0, 1)):
    h_s, head_s, h_t, head_t, labels, weights = args

    def f(h_s, head_s):
        if kind == "reference":
            t = None if h_t is None else TEACHER(h_t, head_t)
            return reference_logit_loss(STUDENT(h_s, head_s), t, labels, weights, coeffs, spec)
        loss = two_pass_logit_loss if kind == "two_pass" else fused_logit_loss
        return loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, student_logits=STUDENT,
                    teacher_logits=None if h_t is None else TEACHER, spec=spec)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(h_s, head_s)
    grads = grads if isinstance(argnums, tuple) else (grads,)
    return float(loss), {k: float(v) for k, v in metrics.items()}, [np.asarray(g) for g in grads]


def assert_same(got, want, rtol=2e-5):
    assert got[0] == pytest.approx(want[0], rel=rtol)
    assert got[1] == pytest.approx(want[1], rel=rtol)
    for g, w in zip(got[2], want[2]):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol * 10, atol=1e-6 * float(np.abs(w).max()))


@pytest.mark.parametrize("vocab_slice", [8, 12, 37, None])
@pytest.mark.parametrize("kl,ce", [(True, True), (True, False), (False, True)])
def test_loss_metrics_and_gradients_equal_autodiff_of_full_logits(vocab_slice, kl, ce):
    spec = LogitLossSettings(kl=kl, ce=ce, chunk=4, vocab_slice=vocab_slice)
    args = inputs()
    want = loss_and_grads("reference", dataclasses.replace(spec, vocab_slice=None), args)
    got = loss_and_grads("two_pass", spec, args)
    assert set(got[1]) == set(want[1]) and got[0] > 0
    assert_same(got, want)
    assert_same(got, loss_and_grads("fused", spec, args))


def test_unit_temperature_frozen_head_and_no_teacher():
    args = inputs(1)
    unit = {**COEFFS, "temperature": 1.0}
    spec = LogitLossSettings(kl=True, ce=True, chunk=4, vocab_slice=10, unit_temperature=True)
    want = loss_and_grads("reference", spec, args, unit)
    assert_same(loss_and_grads("two_pass", spec, args, unit), want)
    assert "kl" in want[1]  # the temperature-1 KL metric is reported as the fused loss reports it
    # a frozen head: only the hidden states' gradient is asked for (symbolic zero for the head)
    frozen = loss_and_grads("two_pass", spec, args, unit, argnums=0)
    np.testing.assert_allclose(frozen[2][0], want[2][0], rtol=2e-4, atol=1e-6 * float(np.abs(want[2][0]).max()))
    # plain cross-entropy, no teacher at all
    no_teacher = args[:2] + (None, None) + args[4:]
    ce_only = LogitLossSettings(kl=False, ce=True, teacher=False, chunk=4, vocab_slice=9)
    assert_same(loss_and_grads("two_pass", ce_only, no_teacher), loss_and_grads("reference", ce_only, no_teacher))


def test_bfloat16_compute_keeps_the_master_heads_dtype_and_tracks_the_fused_loss():
    args = inputs(2, jnp.bfloat16)
    spec = LogitLossSettings(kl=True, ce=True, chunk=4, vocab_slice=16)
    got, want = loss_and_grads("two_pass", spec, args), loss_and_grads("fused", spec, args)
    assert got[2][0].dtype == jnp.bfloat16 and got[2][1].dtype == np.float32  # d(hidden), d(head)
    assert got[0] == pytest.approx(want[0], rel=1e-3)
    for g, w in zip(got[2], want[2]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0,
                                   atol=2e-2 * float(np.abs(np.asarray(w, np.float32)).max()))


def test_settings_it_does_not_compute_are_refused():
    args = inputs()
    for spec in (LogitLossSettings(kl=True, top_k=4), LogitLossSettings(kl=True, jsd=True),
                 LogitLossSettings(kl=True, diagnostics=True)):
        with pytest.raises(ValueError, match="two_pass"):
            loss_and_grads("two_pass", spec, args)
    stage = Stage(steps=1, weights=LossWeights(kl=1.0, jsd=0.5))
    with pytest.raises(ValueError, match="not jsd; use logit_impl='fused'"):
        DistillConfig(stages=(stage,), logit_impl="two_pass")
    with pytest.raises(ValueError, match="not top_k"):
        DistillConfig(stages=(Stage(steps=1),), logit_impl="two_pass", top_k=8)
    with pytest.raises(ValueError, match="'fused', 'fused_xla', 'kernel', 'two_pass', 'reference'"):
        DistillConfig(stages=(Stage(steps=1),), logit_impl="sliced")


def _temporaries(kind, vocab, hidden, rows, vocab_slice):
    spec = LogitLossSettings(kl=True, chunk=128, block=128, vocab_slice=vocab_slice, unit_temperature=True)
    coeffs = {**COEFFS, "temperature": 1.0, "ce": 0.0}
    plain = lambda h, w: jnp.einsum("...D,VD->...V", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    loss = two_pass_logit_loss if kind == "two_pass" else fused_logit_loss

    def f(h_s, head_s, h_t, head_t, labels, weights):
        return loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, student_logits=plain, teacher_logits=plain,
                    spec=spec)[0]

    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((1, rows, hidden), jnp.float32), ((vocab, hidden), jnp.float32),
                                                      ((1, rows, hidden), jnp.float32), ((vocab, hidden), jnp.float32),
                                                      ((1, rows), jnp.int32), ((1, rows), jnp.float32))]
    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temporaries_hold_no_head_sized_accumulator_and_no_full_vocabulary_block():
    """XLA's own memory analysis (CPU), hidden 256 and 512 rows: the fused loss (4 row blocks) keeps a (V, D)
    float32 accumulator and (rows, V) blocks; the two-pass loss's temporaries (1,024-row slices) do not grow with
    the vocabulary: doubling it from 32,768 to 65,536 adds less than 1% of one (V, D) float32 array."""
    hidden, rows = 256, 512
    head_bytes = 32768 * hidden * 4
    assert _temporaries("fused", 32768, hidden, rows, None) > head_bytes
    small, large = (_temporaries("two_pass", vocab, hidden, rows, 1024) for vocab in (32768, 65536))
    assert small < head_bytes / 2 and abs(large - small) < head_bytes / 100, (small, large)


def test_a_train_step_with_two_pass_gives_the_fused_steps_loss_and_gradients():
    import nnx_surgery.distill.loop.train_step as step_lib
    from nnx_surgery.distill.loop.freeze import split_trainable
    from distill_fixtures import LENGTH, VOCAB, step_gradients, student_from, tiny_teacher

    teacher = tiny_teacher()
    student = student_from(teacher)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)).astype(np.int32))

    def run(impl):
        settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8, vocab_slice=24),
                                         logit_impl=impl)
        graph, trainable, rest = split_trainable(student, None, None)
        assert step_lib._embedding_fold(graph, {"student": trainable}, rest, settings)  # tied: folded in both
        return step_gradients(teacher, student, settings, ids)

    want, got = run("fused"), run("two_pass")
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == pytest.approx(want[1], rel=1e-5)
    assert sorted(got[2]) == sorted(want[2])
    for path, w in want[2].items():
        np.testing.assert_allclose(got[2][path], w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()), err_msg=path)
