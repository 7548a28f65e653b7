"""Distillation losses on hand-computable inputs, and the fused chunked logit loss against the plain one."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_surgery.distill.interface import Correspondence, correspondence_from_plan
from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss, reference_logit_loss
from nnx_surgery.distill.labels import labels_and_weights
from nnx_surgery.distill.losses.representations import (attention_transfer_loss, feature_distance, feature_loss,
                                                        group_heads, pool_features, pooling_windows)

COEFFS = dict(temperature=1.0, kl=1.0, reverse_kl=1.0, jsd=1.0, ce=1.0)


def _one_token(s, t, label=0, **spec):
    coeffs = {**COEFFS, **spec.pop("coeffs", {})}
    spec = LogitLossSettings(**{"kl": False, "diagnostics": True, **spec})
    loss, sums = reference_logit_loss(jnp.asarray([s], jnp.float32), jnp.asarray([t], jnp.float32),
                                      jnp.asarray([label]), jnp.ones(1), coeffs, spec)
    return float(loss), {k: float(v) for k, v in sums.items()}


P, Q = np.array([0.75, 0.25]), np.array([0.5, 0.5])  # teacher logits [ln 3, 0], student logits [0, 0]
T_LOGITS, S_LOGITS = [math.log(3.0), 0.0], [0.0, 0.0]


def kl(a, b):
    return float(np.sum(a * np.log(a / b)))


def test_forward_kl_reverse_kl_jsd_and_ce_by_hand():
    assert _one_token(S_LOGITS, T_LOGITS, kl=True)[0] == pytest.approx(kl(P, Q), abs=1e-6)
    assert _one_token(S_LOGITS, T_LOGITS, reverse_kl=True)[0] == pytest.approx(kl(Q, P), abs=1e-6)
    m = 0.5 * (P + Q)
    assert _one_token(S_LOGITS, T_LOGITS, jsd=True)[0] == pytest.approx(0.5 * kl(P, m) + 0.5 * kl(Q, m), abs=1e-6)
    m = 0.2 * P + 0.8 * Q
    assert _one_token(S_LOGITS, T_LOGITS, jsd=True, jsd_beta=0.2)[0] == pytest.approx(
        0.2 * kl(P, m) + 0.8 * kl(Q, m), abs=1e-6)
    loss, sums = _one_token(S_LOGITS, T_LOGITS, label=1, ce=True)
    assert loss == pytest.approx(math.log(2.0), abs=1e-6)
    assert sums["teacher_ce"] == pytest.approx(-math.log(0.25), abs=1e-6)
    assert sums["kl"] == pytest.approx(kl(P, Q), abs=1e-6)  # the KL metric is reported whatever the weights
    assert sums["term/ce"] == pytest.approx(math.log(2.0), abs=1e-6) and "term/kl" not in sums


def test_temperature_scales_logits_and_multiplies_by_t_squared():
    # teacher logits [2 ln 3, 0] at temperature 2 give p = (0.75, 0.25); the divergence is multiplied by 4
    loss, sums = _one_token([0.0, 0.0], [2 * math.log(3.0), 0.0], kl=True, ce=True, coeffs={"temperature": 2.0})
    assert sums["term/kl"] == pytest.approx(kl(P, Q), abs=1e-6)
    assert sums["kl"] == pytest.approx(kl(np.array([0.9, 0.1]), Q), abs=1e-6)  # the metric stays at temperature 1
    assert loss == pytest.approx(4 * kl(P, Q) + math.log(2.0), abs=1e-5)  # CE stays at temperature 1


def test_weights_combine_terms_linearly():
    both, _ = _one_token(S_LOGITS, T_LOGITS, kl=True, ce=True, coeffs={"kl": 0.3, "ce": 0.7})
    assert both == pytest.approx(0.3 * kl(P, Q) + 0.7 * math.log(2.0), abs=1e-6)


def test_top_k_renormalises_the_teacher_over_its_top_logits():
    loss, sums = _one_token([0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1.0], kl=True, top_k=2)
    assert loss == pytest.approx(0.75 * math.log(0.75 * 3) + 0.25 * math.log(0.25 * 3), abs=1e-6)
    full = np.array([3.0, 1.0, math.exp(-1.0)]) / (4.0 + math.exp(-1.0))
    assert sums["kl"] == pytest.approx(kl(full, np.full(3, 1 / 3)), abs=1e-6)  # metric: full teacher
    jsd_loss, _ = _one_token([0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1.0], jsd=True, top_k=2)
    assert math.isfinite(jsd_loss)
    with pytest.raises(ValueError, match="reverse_kl with top_k"):
        LogitLossSettings(reverse_kl=True, top_k=4)


def test_logit_correlation_metric():
    t = [1.0, -2.0, 0.5, 3.0]
    assert _one_token(t, t, kl=True)[1]["logit_corr"] == pytest.approx(1.0, abs=1e-5)
    assert _one_token([-x for x in t], t, kl=True)[1]["logit_corr"] == pytest.approx(-1.0, abs=1e-5)


def test_train_metrics_skip_the_diagnostic_passes_but_keep_the_same_values():
    """Without diagnostics: student_ce and the terms always, the temperature-1 kl only when it is the KL term."""
    full_loss, full = _one_token(S_LOGITS, T_LOGITS, label=1, kl=True, ce=True, unit_temperature=True)
    loss, lean = _one_token(S_LOGITS, T_LOGITS, label=1, kl=True, ce=True, unit_temperature=True, diagnostics=False)
    assert sorted(lean) == ["kl", "student_ce", "term/ce", "term/kl"] and loss == pytest.approx(full_loss, abs=1e-7)
    assert all(lean[k] == pytest.approx(full[k], abs=1e-6) for k in lean)
    hot = {"temperature": 2.0}  # the kl metric (temperature 1) is no longer the loss term: skipped
    _, full = _one_token(S_LOGITS, T_LOGITS, label=1, kl=True, coeffs=hot)
    _, lean = _one_token(S_LOGITS, T_LOGITS, label=1, kl=True, coeffs=hot, diagnostics=False)
    assert sorted(lean) == ["student_ce", "term/kl"]
    assert lean["student_ce"] == pytest.approx(full["student_ce"], abs=1e-6) == math.log(2.0)


def test_labels_and_weights_exclude_last_position_padding_and_prompt():
    ids = jnp.asarray([[5, 6, 7, 8, 0]])
    labels, weights = labels_and_weights(ids, jnp.asarray([[0, 1, 1, 1, 1]]), jnp.asarray([[1, 1, 1, 1, 0]]))
    np.testing.assert_array_equal(labels, [[6, 7, 8, 0, 0]])
    # position 0 is a prompt token (loss_mask 0), position 3 predicts padding, position 4 is padding and last
    np.testing.assert_array_equal(weights, [[0, 1, 1, 0, 0]])


def _softcapped(cap):
    return lambda h, w: jnp.tanh(jnp.einsum("...d,vd->...v", h, w.astype(h.dtype),
                                            preferred_element_type=jnp.float32) / cap) * cap


CASES = [(dict(kl=True), 64), (dict(kl=True), 6), (dict(kl=False, reverse_kl=True, ce=True), 6),
         (dict(kl=True, jsd=True, ce=True, top_k=5, diagnostics=True), 6), (dict(kl=False, jsd=True, jsd_beta=0.3), 4),
         (dict(kl=True, ce=True, block=8, diagnostics=True), 4),  # blocks of 2 chunks, the last one padded
         (dict(kl=True, block=12), 4), (dict(kl=True, ce=True, block=64), 2),  # 3 chunks; one block of 7
         (dict(kl=True, block=8, vocab_slice=6, vocab=24), 4), (dict(reverse_kl=True, vocab_slice=5, vocab=24), 6),
         (dict(kl=True, ce=True, unit_temperature=True, temperature=1.0, block=12), 6),  # closed form, CE from q
         (dict(kl=False, ce=True, teacher=False, block=8), 4)]  # plain cross-entropy training (closed form)


@pytest.mark.parametrize("spec_kwargs,chunk", CASES)  # chunk in rows: 6 rows = 3 positions, the sequence is padded
def test_fused_chunked_equals_reference_values_and_gradients(spec_kwargs, chunk):
    spec_kwargs = dict(spec_kwargs)
    batch, length, d_s, d_t, vocab = 2, 7, 6, 8, spec_kwargs.pop("vocab", 23)
    temperature = spec_kwargs.pop("temperature", 2.5)
    keys = jax.random.split(jax.random.key(0), 6)
    h_s, head_s = jax.random.normal(keys[0], (batch, length, d_s)), jax.random.normal(keys[1], (vocab, d_s))
    h_t, head_t = jax.random.normal(keys[2], (batch, length, d_t)), jax.random.normal(keys[3], (vocab, d_t))
    labels = jax.random.randint(keys[4], (batch, length), 0, vocab)
    weights = jax.random.uniform(keys[5], (batch, length)) * (jnp.arange(length) < length - 1)
    coeffs = dict(temperature=jnp.float32(temperature), kl=0.7, reverse_kl=0.4, jsd=1.3, ce=0.2)
    spec = LogitLossSettings(**spec_kwargs, chunk=chunk)
    student, teacher = _softcapped(3.0), _softcapped(5.0)
    if not spec.teacher:
        h_t = head_t = None

    def reference(h, w):
        t = None if h_t is None else teacher(h_t, head_t)
        return reference_logit_loss(student(h, w), t, labels, weights, coeffs, spec)

    def fused(h, w):
        return fused_logit_loss(h, w, h_t, head_t, labels, weights, coeffs, student_logits=student,
                                teacher_logits=teacher, spec=spec)

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def everything(h, w):
        return (jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(h, w),
                jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(h, w),
                jax.grad(lambda h: fused(h, w)[0])(h),  # a frozen head: only d(hidden) is computed
                fused(h, w)[0])  # no gradient requested: the primal path

    ((ref_loss, ref_sums), ref_grads), ((loss, sums), grads), grad_h, primal = everything(h_s, head_s)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(primal, ref_loss, rtol=1e-5)
    for name in ref_sums:
        np.testing.assert_allclose(sums[name], ref_sums[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_h, ref_grads[0], rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(ref_grads[1]).max()) > 1e-3  # the comparison is not between zeros


def test_attention_transfer_by_hand_with_masked_keys_and_padding_queries():
    teacher = jnp.asarray([[[[1.0, 0.0], [0.5, 0.5]]]])  # (B=1, N=1, T=2, S=2); row 0 has one allowed key
    student = jnp.asarray([[[[1.0, 0.0], [0.75, 0.25]]]])
    corr = Correspondence(layer_map=((0, 0),))
    loss = attention_transfer_loss([teacher], [student], corr, jnp.asarray([[0.5, 0.5]]))
    assert float(loss) == pytest.approx(0.5 * kl(np.array([0.5, 0.5]), np.array([0.75, 0.25])), abs=1e-6)
    loss = attention_transfer_loss([teacher], [student], corr, jnp.asarray([[1.0, 0.0]]))  # row 1 is padding
    assert float(loss) == pytest.approx(0.0, abs=1e-7)


def test_attention_transfer_groups_heads_when_counts_differ():
    rng = np.random.default_rng(0)
    teacher = jax.nn.softmax(jnp.asarray(rng.normal(size=(1, 4, 3, 3))), axis=-1)
    student = jax.nn.softmax(jnp.asarray(rng.normal(size=(1, 2, 3, 3))), axis=-1)
    weights = jnp.full((1, 3), 1 / 3)
    grouped = np.asarray(group_heads(teacher, 2))
    np.testing.assert_allclose(grouped[0, 0], (teacher[0, 0] + teacher[0, 1]) / 2, rtol=1e-6)
    expected = np.mean([[kl(grouped[0, g, t], np.asarray(student[0, g, t])) for t in range(3)] for g in range(2)])
    corr = Correspondence(layer_map=((1, 0),))
    loss = attention_transfer_loss([teacher * 0, teacher], [student], corr, weights)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # with a head map, the kept teacher heads are compared one to one
    mapped = Correspondence(layer_map=((1, 0),), head_map=((3, 0),))
    expected = np.mean([[kl(np.asarray(teacher[0, h, t]), np.asarray(student[0, g, t])) for t in range(3)]
                        for g, h in enumerate((3, 0))])
    assert float(attention_transfer_loss([teacher * 0, teacher], [student], mapped, weights)) == pytest.approx(
        expected, rel=1e-5)


def test_feature_distances_by_hand():
    s, t = jnp.asarray([1.0, 2.0]), jnp.asarray([0.0, 0.0])
    assert float(feature_distance(s, t, "mse")) == pytest.approx(2.5)
    assert float(feature_distance(jnp.asarray([1.0, 0.0]), jnp.asarray([0.0, 3.0]), "cosine")) == pytest.approx(1.0)
    assert float(feature_distance(jnp.asarray([2.0, 0.0]), jnp.asarray([1.0, 0.0]), "cosine")) == pytest.approx(0.0)
    assert float(feature_distance(jnp.asarray([3.0, 4.0]), jnp.asarray([0.0, 4.0]), "nmse")) == pytest.approx(
        9 / 16, rel=1e-5)
    zero = feature_distance(jnp.zeros(2), jnp.zeros(2), "cosine")
    assert float(zero) == pytest.approx(1.0)  # not NaN


def test_feature_loss_uses_kept_channels_layer_map_and_projections():
    teacher_out = jnp.asarray([[[1.0, 5.0, 2.0]]])  # (B=1, T=1, D_t=3), output of teacher layer 1
    student_out = jnp.asarray([[[1.0, 3.0]]])  # (B=1, T=1, D_s=2), output of student layer 0
    teacher_residual = [jnp.zeros((1, 1, 3)), jnp.zeros((1, 1, 3)), teacher_out]
    student_residual = [jnp.zeros((1, 1, 2)), student_out]
    plan = {"kept_layers": [1], "kept_hidden": [0, 2]}
    corr = correspondence_from_plan(plan)
    assert corr.layer_map == ((1, 0),) and corr.kept_hidden == (0, 2)
    loss = feature_loss(teacher_residual, student_residual, corr, jnp.ones((1, 1)), "mse")
    assert float(loss) == pytest.approx((0 + 1) / 2)  # student [1, 3] vs teacher channels [1, 2]
    projection = {"0": jnp.asarray([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])}  # student -> teacher space: [1, 6, 0]
    loss = feature_loss(teacher_residual, student_residual, Correspondence(((1, 0),)), jnp.ones((1, 1)), "mse",
                        projection)
    assert float(loss) == pytest.approx((0 + 1 + 4) / 3)
    with pytest.raises(ValueError, match="kept_hidden"):
        feature_loss(teacher_residual, student_residual, Correspondence(((1, 0),)), jnp.ones((1, 1)), "mse")


def test_pooled_features_average_teacher_channel_windows_by_hand():
    """Tunix's VALID pooling: contiguous groups of D_t / D_s channels when D_s divides D_t, else overlapping windows
    of width D_t - (D_s - 1) * stride at stride D_t // D_s."""
    teacher = np.arange(12.0).reshape(1, 2, 6) ** 1.5  # (B=1, T=2, D_t=6)
    pooled = np.asarray(pool_features(jnp.asarray(teacher), 3))
    by_hand = [[(teacher[0, t, 0] + teacher[0, t, 1]) / 2, (teacher[0, t, 2] + teacher[0, t, 3]) / 2,
                (teacher[0, t, 4] + teacher[0, t, 5]) / 2] for t in range(2)]
    np.testing.assert_allclose(pooled[0], by_hand, rtol=1e-6)
    assert pooling_windows(10, 4) == (2, 4)  # windows [0, 4), [2, 6), [4, 8), [6, 10)
    wide = np.asarray([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]) ** 2
    np.testing.assert_allclose(np.asarray(pool_features(jnp.asarray(wide), 4)),
                               [(0 + 1 + 4 + 9) / 4, (4 + 9 + 16 + 25) / 4, (16 + 25 + 36 + 49) / 4,
                                (36 + 49 + 64 + 81) / 4], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pool_features(jnp.asarray(wide), 10)), wide)  # same width: unchanged
    with pytest.raises(ValueError, match="no wider than the teacher"):
        pool_features(jnp.ones((1, 1, 4)), 8)


def test_pooled_feature_loss_is_the_cosine_distance_to_the_pooled_teacher():
    teacher_out = jnp.asarray([[[1.0, 3.0, 4.0, 0.0], [2.0, 2.0, 0.0, 6.0]]])  # (B=1, T=2, D_t=4): pooled [2, 2], [2, 3]
    student_out = jnp.asarray([[[1.0, 0.0], [4.0, 6.0]]])  # (B=1, T=2, D_s=2)
    residual_t = [jnp.zeros((1, 2, 4)), teacher_out]
    residual_s = [jnp.zeros((1, 2, 2)), student_out]
    weights = jnp.asarray([[0.25, 0.75]])
    cos_first = 2.0 / (1.0 * math.sqrt(8.0))  # student [1, 0] vs pooled teacher [2, 2]
    expected = 0.25 * (1 - cos_first) + 0.75 * 0.0  # [4, 6] is parallel to [2, 3]
    # kept_hidden is ignored: pooling replaces channel selection
    corr = Correspondence(layer_map=((0, 0),), kept_hidden=(0, 1))
    loss = feature_loss(residual_t, residual_s, corr, weights, "pooled")
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="no learned projection"):
        feature_loss(residual_t, residual_s, corr, weights, "pooled", {"0": jnp.ones((2, 4))})


def test_pooled_feature_term_trains_a_width_pruned_student(tmp_path):
    """feature_kind="pooled" in the train step: a student cut to half the teacher's width (32 -> 16 channels,
    contiguous pairs pooled) trained on the feature term alone lowers it."""
    from nnx_surgery.surgery import StudentSpec, apply_plan, plan_student
    from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
    from nnx_surgery.distill.loop.trainer import run
    from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, ArrayBatches, teacher_samples, tiny_teacher

    teacher = tiny_teacher()
    batches = teacher_samples(teacher, 6, seed=2)
    plan = plan_student(teacher, StudentSpec(2, 16, 32, 2, 1))
    student = apply_plan(teacher, plan)
    assert student.config.hidden_size == 16
    stage = Stage(steps=8, learning_rate=1e-2, weights=LossWeights(kl=0.0, feature=1.0))
    config = DistillConfig(stages=(stage,), batch_size=BATCH, seq_len=LENGTH, plan=plan,
                           loss_options={"feature": {"kind": "pooled"}},
                           progress=False, logit_chunk=16, eval_every=None, compiler_options=FAST_COMPILE)
    result = run(teacher, student, ArrayBatches(batches[:4]), config, eval_data=batches[4:])
    feature = [record["loss/feature"] for record in result.history]
    assert all(math.isfinite(value) for value in feature)
    assert feature[-1] < 0.8 * feature[0], feature  # measured 0.80 -> 0.55


def test_fused_loss_memory_does_not_grow_with_sequence_length():
    """Compiled temporary memory of loss + gradient (XLA's memory analysis; nothing runs): the reference holds
    several (B, T, V) float32 arrays, the fused loss a few (chunk rows, V) blocks and the (V, D) head gradient,
    the same for T = 64 and T = 256."""
    batch, dim, vocab = 2, 16, 8192
    coeffs = dict(temperature=1.0, kl=1.0, reverse_kl=0.0, jsd=0.0, ce=0.0)
    spec = LogitLossSettings(kl=True, chunk=32)
    logits = _softcapped(30.0)

    def temp_bytes(length, implementation):
        labels, weights = jnp.zeros((batch, length), jnp.int32), jnp.ones((batch, length), jnp.float32)

        def reference(h_s, w_s, h_t, w_t):
            return reference_logit_loss(logits(h_s, w_s), logits(h_t, w_t), labels, weights, coeffs, spec)[0]

        def fused(h_s, w_s, h_t, w_t):
            return fused_logit_loss(h_s, w_s, h_t, w_t, labels, weights, coeffs, student_logits=logits,
                                    teacher_logits=logits, spec=spec)[0]

        h = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)
        head = jax.ShapeDtypeStruct((vocab, dim), jnp.float32)
        fn = {"reference": reference, "fused": fused}[implementation]
        compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(h, head, h, head).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full_logits = batch * 256 * vocab * 4
    assert temp_bytes(256, "reference") > 2 * full_logits
    fused_long = temp_bytes(256, "fused")
    assert fused_long < 0.4 * full_logits  # measured 0.32
    assert fused_long < 1.2 * temp_bytes(64, "fused")


@pytest.mark.parametrize("block", [None, 16])
def test_fused_bfloat16_compute_matches_float32_reference(block):
    """bf16 hidden states with a float32 master head (the mixed-precision step): loss and gradients within bf16
    rounding of the float32 reference on the same (bf16-rounded) inputs; the head gradient comes back float32."""
    batch, length, dim, vocab = 2, 16, 32, 64
    keys = jax.random.split(jax.random.key(3), 5)
    h_s = jax.random.normal(keys[0], (batch, length, dim)).astype(jnp.bfloat16)
    head_s = 0.3 * jax.random.normal(keys[1], (vocab, dim))
    h_t = jax.random.normal(keys[2], (batch, length, dim)).astype(jnp.bfloat16)
    head_t = (0.3 * jax.random.normal(keys[3], (vocab, dim))).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[4], (batch, length), 0, vocab)
    weights = jnp.full((batch, length), 1.0 / (batch * length))
    coeffs = dict(temperature=1.0, kl=1.0, reverse_kl=0.0, jsd=0.0, ce=0.5)
    spec = LogitLossSettings(kl=True, ce=True, chunk=8, block=block)
    logits = _softcapped(30.0)

    def fused(h, w):
        return fused_logit_loss(h, w, h_t, head_t, labels, weights, coeffs, student_logits=logits,
                                teacher_logits=logits, spec=spec)[0]

    def reference(h, w):
        t = logits(h_t.astype(jnp.float32), head_t.astype(jnp.float32))
        return reference_logit_loss(logits(h, w.astype(jnp.bfloat16).astype(jnp.float32)), t, labels, weights,
                                    coeffs, spec)[0]

    loss, (d_h, d_head) = jax.value_and_grad(fused, argnums=(0, 1))(h_s, head_s)
    want, (want_h, want_head) = jax.value_and_grad(reference, argnums=(0, 1))(h_s.astype(jnp.float32), head_s)
    assert d_h.dtype == jnp.bfloat16 and d_head.dtype == jnp.float32
    np.testing.assert_allclose(loss, want, rtol=1e-3)
    for got, ref in ((d_h, want_h), (d_head, want_head)):
        scale = float(jnp.abs(ref).max())
        assert scale > 1e-3
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=0, atol=2e-2 * scale)


def test_closed_form_gradient_covers_the_common_objectives_only():
    """The fused loss's closed-form dz (distill.losses.logit_grad) is used for forward KL / CE without top-k or
    diagnostics when a block holds several chunks; the other CASES above go through autodiff, so both paths are
    compared with the reference."""
    from nnx_surgery.distill.losses.divergence import chunk_positions, closed_form_applies

    batch, length = 2, 7  # the shapes of test_fused_chunked_equals_reference_values_and_gradients
    closed = []
    for kwargs, chunk in CASES:
        spec = LogitLossSettings(**{k: v for k, v in kwargs.items() if k not in ("vocab", "temperature")}, chunk=chunk)
        positions, block = chunk_positions(batch, length, spec)
        closed.append(closed_form_applies(spec, block // positions))
    assert sum(closed) >= 5 and len(closed) - sum(closed) >= 5, closed
    assert closed_form_applies(LogitLossSettings(kl=True, ce=True, block=64, vocab_slice=32768), 2)
    assert not closed_form_applies(LogitLossSettings(kl=True, ce=True, block=64), 1)  # one chunk per block
    for other in (dict(reverse_kl=True), dict(jsd=True), dict(top_k=8), dict(diagnostics=True)):
        assert not closed_form_applies(LogitLossSettings(kl=True, **other), 2)
