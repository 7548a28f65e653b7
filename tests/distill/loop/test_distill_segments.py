"""Packed documents in the train step, the eval step and held-out scoring: a packed row scores each document as it
would be scored alone (every loss term: logits, attention transfer, features), attention crosses no document
boundary, no target crosses one, and gradient accumulation over packed micro-batches equals one big batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import DistillConfig, Stage
from nnx_surgery.distill.inputs.batches import TokenBatches
from nnx_surgery.evaluation.perplexity import agreement_and_kl, heldout_loss
from nnx_surgery.distill.loop.freeze import split_trainable
from nnx_surgery.distill.interface import Correspondence, forward_inputs, next_token_targets
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.distill.loop.driver import _stack
from distill_fixtures import FAST_COMPILE, VOCAB, student_from, tiny_teacher

BOS, EOS = 2, 1
# raw lengths; with BOS and EOS each document is 2 longer: rows of 18 are [7 5 6], [10 8], [11 + 7 padding]
LENGTHS = (5, 3, 4, 8, 6, 9)
SEQ = 18
IDENTITY = Correspondence(layer_map=((0, 0), (1, 1)))  # two-layer student of the first two teacher layers
HYPER = {k: jnp.float32(v) for k, v in dict(lr=0.0, weight_decay=0.0, temperature=2.0, kl=1.0, reverse_kl=0.0,
                                            jsd=0.0, ce=0.5, attention=1.0, feature=1.0).items()}


def _documents():
    rng = np.random.default_rng(7)
    return [rng.integers(4, VOCAB, n).astype(np.int32) for n in LENGTHS]


def _packed(batch_size=3):
    data = TokenBatches.from_arrays(_documents(), eos_id=EOS, bos_id=BOS, seq_len=SEQ, batch_size=batch_size,
                                    eval_fraction=0, shuffle=False, drop_remainder=False)  # segments by default
    return data.next_batch()


def _alone():
    """Each document alone in its own row, as the pipeline would make it ([BOS] ids [EOS], every real target
    scored), right padded to SEQ and masked: causal attention never sees the padding after a document."""
    rows = [np.concatenate([[BOS], document, [EOS]]).astype(np.int32) for document in _documents()]
    ids = np.zeros((len(rows), SEQ), np.int32)
    mask = np.zeros((len(rows), SEQ), np.float32)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1.0
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": mask.astype(np.int32)}


@pytest.fixture(scope="module")
def models():
    teacher = tiny_teacher()
    return teacher, student_from(teacher)


def test_packed_rows_hold_whole_documents():
    batch = _packed()
    np.testing.assert_array_equal(batch["segment_ids"], [[1] * 7 + [2] * 5 + [3] * 6, [1] * 10 + [2] * 8,
                                                         [1] * 11 + [0] * 7])
    assert batch["input_ids"][0, 7] == BOS and batch["positions"][0, 7] == 0


def test_no_target_crosses_a_document_boundary():
    ids = jnp.arange(8)[None]
    segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    _, weights, real = next_token_targets({"input_ids": ids, "segment_ids": segments})
    np.testing.assert_array_equal(weights[0], [1, 1, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(real[0], [1, 1, 1, 1, 1, 1, 0, 0])


def _terms(student, teacher, batch):
    """Every loss term and metric sum of make_loss_fn on one (B, T) batch, with the batch's own normalisers."""
    graph, trainable, frozen = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8, diagnostics=True),
                                     terms=("attention", "feature"), correspondence=IDENTITY)
    loss_fn = step_lib.make_loss_fn(graph, teacher_graph, settings)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    counts = step_lib.token_counts(jax.tree.map(lambda x: x[None], batch))
    run = jax.jit(loss_fn, compiler_options=FAST_COMPILE)
    _, metrics = run({"student": trainable, "proj": {}}, frozen, teacher_state, batch, counts, HYPER)
    return {k: float(v) for k, v in metrics.items()}, {k: float(v) for k, v in counts.items()}


def test_step_scores_each_packed_document_as_if_alone(models):
    teacher, student = models
    student = student_from(teacher, kept=(0, 1))  # identity layer map: attention and feature terms line up
    packed, counts = _terms(student, teacher, _packed())
    alone, alone_counts = _terms(student, teacher, _alone())
    assert counts == alone_counts == {"tokens": sum(n + 1 for n in LENGTHS), "positions": sum(n + 2 for n in LENGTHS)}
    assert set(packed) == set(alone) >= {"loss/logit", "loss/attention", "loss/feature", "student_ce", "kl"}
    for key, value in packed.items():
        assert value == pytest.approx(alone[key], rel=2e-4, abs=1e-6), key
    leaky, _ = _terms(student, teacher, {k: v for k, v in _packed().items() if k not in ("positions", "segment_ids")})
    assert leaky["student_ce"] != pytest.approx(packed["student_ce"], rel=1e-3)  # the check can fail


def test_eval_step_and_heldout_scoring_equal_documents_alone(models):
    teacher, student = models
    graph, state = nnx.split(student)
    teacher_graph, teacher_state = nnx.split(teacher)
    evaluate = step_lib.build_eval_step(graph, teacher_graph, chunk=8, compiler_options=FAST_COMPILE)
    as_arrays = lambda b: {k: jnp.asarray(v) for k, v in b.items()}
    packed = {k: float(v) for k, v in evaluate(state, teacher_state, as_arrays(_packed())).items()}
    alone = {k: float(v) for k, v in evaluate(state, teacher_state, as_arrays(_alone())).items()}
    assert packed["supervised_tokens"] == alone["supervised_tokens"] == sum(n + 1 for n in LENGTHS)
    for key in ("loss", "kl", "student_ce", "teacher_ce", "logit_corr"):
        assert packed[key] == pytest.approx(alone[key], rel=2e-4), key

    packed_loss, alone_loss = heldout_loss(student, [_packed()]), heldout_loss(student, [_alone()])
    assert packed_loss["tokens"] == alone_loss["tokens"]
    assert packed_loss["loss"] == pytest.approx(alone_loss["loss"], rel=1e-5)
    together, apart = agreement_and_kl(student, teacher, [_packed()]), agreement_and_kl(student, teacher, [_alone()])
    assert together["tokens"] == apart["tokens"] and together["kl"] == pytest.approx(apart["kl"], rel=1e-4)
    assert together["top1_agreement"] == pytest.approx(apart["top1_agreement"], abs=1e-9)


def test_attention_stays_inside_each_document(models):
    teacher, _ = models
    batch = {k: jnp.asarray(v) for k, v in _packed().items()}
    out = teacher(batch["input_ids"], **forward_inputs(teacher, batch), capture=("attention_probs",))
    segments = np.asarray(batch["segment_ids"])
    other = segments[:, :, None] != segments[:, None, :]  # (B, T, S): key in another document (or padding)
    real = segments[:, :, None] > 0
    for probs in out.attention_probs:
        mass = np.asarray(probs).sum(1)  # (B, T, S) over heads
        assert np.all(mass[np.broadcast_to(other & real, mass.shape)] == 0.0)


def test_packed_batch_needs_a_model_that_takes_segments():
    class OldModel:
        def __call__(self, input_ids, *, attention_mask=None, capture=(), return_logits=True):
            raise AssertionError("not reached")

    with pytest.raises(TypeError, match="segment_ids"):
        forward_inputs(OldModel(), _packed())
    assert set(forward_inputs(OldModel(), {"input_ids": 0, "attention_mask": 1})) == {"attention_mask"}


def test_gradient_accumulation_over_packed_micro_batches_equals_one_batch(models):
    teacher, student = models
    config = DistillConfig(stages=(Stage(steps=1),), batch_size=1, seq_len=SEQ, grad_accum=2)
    rows = _packed(batch_size=2)
    micro = _stack([{k: v[i:i + 1] for k, v in rows.items()} for i in range(2)], config)
    assert set(micro) == {"input_ids", "loss_mask", "positions", "segment_ids"}
    assert micro["segment_ids"].shape == (2, 1, SEQ) and micro["positions"].dtype == np.int32
    whole = {k: v[None] for k, v in rows.items()}

    def one_step(batch):
        graph, trainable, frozen = split_trainable(student, None, None)
        teacher_graph, teacher_state = nnx.split(teacher)
        settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8), terms=("feature",),
                                         correspondence=IDENTITY, clip_norm=None)
        adam = step_lib.AdamSettings()
        step = step_lib.build_train_step(graph, teacher_graph, settings, adam, compiler_options=FAST_COMPILE)
        params = {"student": jax.tree.map(jnp.copy, trainable), "proj": {}}
        hyper = {**HYPER, "lr": jnp.float32(1e-2)}
        new, _, metrics = step(params, adam.transform().init(params), frozen, teacher_state,
                               {k: jnp.asarray(v) for k, v in batch.items()}, hyper)
        return jax.tree.leaves(new), {k: float(v) for k, v in metrics.items()}

    (accumulated, m_acc), (single, m_one) = one_step(micro), one_step(whole)
    assert m_acc["supervised_tokens"] == m_one["supervised_tokens"] == sum(n + 1 for n in LENGTHS[:5])
    assert m_acc["loss"] == pytest.approx(m_one["loss"], rel=1e-5)
    assert m_acc["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    # Adam's first update is about lr * g / |g|: where a gradient is near zero, float32 summation order (one machine's
    # XLA build against another's) moves it by a fraction of lr (1e-2). 1e-4 is 1% of a step: a wrong accumulation
    # (a micro-batch dropped, counted twice or mis-normalised) moves parameters by the order of lr.
    for a, b in zip(accumulated, single):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
