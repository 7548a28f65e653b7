"""The cosine loss on hidden states: its value against numpy (kept channels, padding, a zero vector), its
gradient in the train step next to the NMSE feature loss, and a run that weights both."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.losses.cosine import COSINE
from nnx_surgery.distill.loop.freeze import split_trainable
from nnx_surgery.distill.interface import Correspondence
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.distill.losses.term_types import ModelSide, TermInputs
from nnx_surgery.distill.loop.trainer import run
from distill_fixtures import (BATCH, FAST_COMPILE, KEPT_LAYERS, LENGTH, VOCAB, student_from, teacher_samples,
                              tiny_teacher)


def _numpy_cosine(teacher_residual, student_residual, layer_map, kept, real):
    """Mean over layer pairs of the mean over real positions of 1 - cos (a zero vector: distance 1)."""
    per_pair = []
    for t_layer, s_layer in layer_map:
        t = np.asarray(teacher_residual[t_layer + 1], np.float64)
        t = t if kept is None else t[..., list(kept)]
        s = np.asarray(student_residual[s_layer + 1], np.float64)
        norms = np.linalg.norm(t, axis=-1) * np.linalg.norm(s, axis=-1)
        cos = np.where(norms > 0, np.sum(t * s, axis=-1) / np.where(norms > 0, norms, 1.0), 0.0)
        per_pair.append(np.sum((1.0 - cos) * real) / np.sum(real))
    return float(np.mean(per_pair))


def _side(residual):
    return ModelSide(hidden=None, head=None, captured={"residual": residual}, model=None)


def test_cosine_value_on_kept_channels_over_real_positions():
    rng = np.random.default_rng(0)
    teacher = [jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32) for _ in range(4)]  # embeddings + 3 layers
    student = [jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32) for _ in range(3)]  # embeddings + 2 layers
    student[2] = student[2].at[0, 1].set(0.0)  # a zero vector at a real position: distance 1, not NaN
    real = np.ones((2, 5), np.float32)
    real[1, 3:] = 0.0  # padding
    corr = Correspondence(layer_map=((0, 0), (2, 1)), kept_hidden=(5, 0, 2, 3))
    inputs = TermInputs(teacher=_side(teacher), student=_side(student), labels=None, token_weights=None,
                        query_weights=jnp.asarray(real / real.sum()), correspondence=corr, projections=None,
                        hyper={"cosine": jnp.float32(0.5)}, settings=None)
    want = _numpy_cosine(teacher, student, corr.layer_map, corr.kept_hidden, real)
    assert float(COSINE.compute(inputs)) == pytest.approx(want, rel=1e-5)
    contribution, metrics = COSINE.contribution(inputs)
    assert float(contribution) == pytest.approx(0.5 * want, rel=1e-5)
    assert float(metrics["loss/cosine"]) == pytest.approx(want, rel=1e-5)
    same_directions = [3.0 * teacher[i][..., [5, 0, 2, 3]] for i in (0, 1, 3)]  # outputs of teacher layers 0, 2
    aligned = dataclasses.replace(inputs, student=_side(same_directions))
    assert float(COSINE.compute(aligned)) == pytest.approx(0.0, abs=1e-6)  # scale-free: same directions, 0


def test_cosine_trains_in_the_step_together_with_the_feature_loss():
    teacher = tiny_teacher()
    student = student_from(teacher)
    graph, trainable, frozen = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    corr = Correspondence(layer_map=tuple((t, s) for s, t in enumerate(KEPT_LAYERS)))
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, chunk=8), terms=("feature", "cosine"),
                                     correspondence=corr)
    grad_fn = jax.jit(step_lib.make_grad_fn(graph, teacher_graph, settings), compiler_options=FAST_COMPILE)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH)), jnp.int32)
    mask = jnp.ones((2, LENGTH), jnp.int32).at[1, LENGTH - 4:].set(0)
    batch = {"input_ids": ids, "attention_mask": mask}
    counts = step_lib.token_counts(jax.tree.map(lambda x: x[None], batch))
    results = {}
    for cosine in (0.0, 1.0):
        hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, feature=1.0, cosine=cosine)), 0,
                                      0.0)
        (loss, metrics), grads = grad_fn({"student": trainable, "proj": {}}, frozen, teacher_state, batch, counts,
                                         hyper)
        results[cosine] = float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.leaves(grads)

    t_res = teacher(ids, attention_mask=mask, capture=("residual",), return_logits=False).residual
    s_res = student(ids, attention_mask=mask, capture=("residual",), return_logits=False).residual
    want = _numpy_cosine(t_res, s_res, corr.layer_map, None, np.asarray(mask, np.float32))
    (loss_off, metrics_off, grads_off), (loss_on, metrics_on, grads_on) = results[0.0], results[1.0]
    assert want > 1e-3 and metrics_on["loss/cosine"] == pytest.approx(want, rel=1e-4)
    assert metrics_off["loss/feature"] > 0
    assert metrics_on["loss/feature"] == pytest.approx(metrics_off["loss/feature"], rel=1e-6)
    assert loss_on == pytest.approx(loss_off + want, rel=1e-5)
    changed = [not np.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(grads_off, grads_on)]
    assert sum(changed) >= len(changed) // 2  # the cosine gradient reaches the student's layers


def test_a_run_weights_cosine_and_feature_from_the_plan():
    teacher = tiny_teacher()
    student = student_from(teacher)
    batches = teacher_samples(teacher, 1, seed=5) * 3  # one batch three times: its losses must fall
    config = DistillConfig(stages=(Stage(steps=3, learning_rate=1e-2,
                                         weights=LossWeights(kl=1.0, feature=0.5, cosine=0.5)),),
                           plan={"kept_layers": list(KEPT_LAYERS)}, batch_size=BATCH, seq_len=LENGTH,
                           progress=False, logit_chunk=16, compiler_options=FAST_COMPILE)
    history = run(teacher, student, batches, config).history
    assert len(history) == 3 and all(np.isfinite(r["loss/cosine"]) and r["loss/feature"] > 0 for r in history)
    assert history[-1]["loss/cosine"] < history[0]["loss/cosine"]
