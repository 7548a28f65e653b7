"""Loss terms as objects: weights keyed by registered names, the step's hyperparameters and switches derived from
the registry, and a term defined outside the package trained by the step after one `register` call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.step as step_lib
from nnx_surgery.distill import terms
from nnx_surgery.distill.config import LossWeights, Stage
from nnx_surgery.distill.freeze import split_trainable
from nnx_surgery.distill.logit_loss import LogitLossSettings
from nnx_surgery.distill.loss_term import LossTerm, TermInputs
from test_distill_train import FAST_COMPILE, LENGTH, VOCAB, student_from, tiny_teacher

BUILT_IN = ("kl", "reverse_kl", "jsd", "ce", "attention", "feature")


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry for tests that register terms."""
    monkeypatch.setattr(terms, "_REGISTRY", dict(terms._REGISTRY))
    return terms


def test_weights_are_keyed_by_registered_names():
    weights = LossWeights(kl=0.5, ce=0.5, feature=1.0)
    assert set(BUILT_IN) <= set(weights) and weights["feature"] == weights.feature == 1.0
    assert weights["attention"] == 0.0 and weights.active() == {"kl", "ce", "feature"}
    assert LossWeights()["kl"] == 1.0 and LossWeights(ce=1.0).active() == {"kl", "ce"}  # kl is 1 unless given
    assert LossWeights({"kl": 0.5, "ce": 0.5, "feature": 1.0}) == weights == {"kl": 0.5, "ce": 0.5, "feature": 1.0}
    assert hash(LossWeights(kl=0.5, ce=0.5, feature=1.0)) == hash(weights)
    assert LossWeights.mixed(0.25, "jsd", feature=2.0).active_items() == {"jsd": 0.25, "ce": 0.75, "feature": 2.0}
    assert Stage(steps=1, weights={"kl": 0.0, "ce": 1.0}).weights == LossWeights(kl=0.0, ce=1.0)
    assert repr(LossWeights(kl=0.0, ce=1.0)) == "LossWeights(ce=1.0)"
    with pytest.raises(ValueError, match=r"unknown loss weight\(s\) \['klx'\]; registered: kl, reverse_kl"):
        LossWeights(klx=1.0)
    with pytest.raises(ValueError, match="finite number"):
        LossWeights(kl=float("nan"))
    with pytest.raises(AttributeError):
        LossWeights().nothing_like_this  # noqa: B018


def test_step_hyperparameters_and_switches_come_from_the_registry():
    assert terms.hyper_keys()[:3] == ("lr", "weight_decay", "temperature")
    assert set(BUILT_IN) <= set(terms.hyper_keys()[3:]) == set(terms.weight_names())
    hyper = step_lib.hyper_values(Stage(steps=4, weights=LossWeights(kl=0.5, feature=2.0)), 0, 0.0)
    assert tuple(hyper) == terms.hyper_keys() and float(hyper["feature"]) == 2.0 and float(hyper["ce"]) == 0.0
    assert [t.name for t in terms.active_terms(LossWeights(kl=0.0, ce=1.0, attention=0.1))] == ["logit", "attention"]
    assert terms.needing_teacher(LossWeights(kl=0.0, ce=1.0)) == []
    assert terms.needing_teacher(LossWeights(kl=0.0, ce=1.0, feature=1.0)) == ["feature"]
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True), terms=("feature", "attention"))
    assert [t.name for t in settings.loss_terms] == ["logit", "feature", "attention"]
    assert settings.captures == ("residual", "attention_probs")
    with pytest.raises(ValueError, match="no loss term 'cosinus'; registered terms: logit, attention, feature"):
        step_lib.StepSettings(logit=LogitLossSettings(), terms=("cosinus",))
    with pytest.raises(ValueError, match="always computed"):
        step_lib.StepSettings(logit=LogitLossSettings(), terms=("logit",))


def test_register_refuses_taken_names(registry):
    with pytest.raises(ValueError, match=r"\['feature'\] already registered"):
        registry.register(LossTerm(name="feature", compute=lambda inputs: 0.0))
    with pytest.raises(ValueError, match=r"\['temperature'\]"):
        registry.register(LossTerm(name="temperature", compute=lambda inputs: 0.0))
    with pytest.raises(ValueError, match="identifier"):
        LossTerm(name="two words")


def _final_hidden_gap(inputs: TermInputs) -> jax.Array:
    """Mean over real positions of the squared difference of the final hidden states (a user's own loss)."""
    gap = jnp.sum(jnp.square(inputs.student.hidden - inputs.teacher.hidden), axis=-1)
    return jnp.sum(gap * inputs.query_weights)


def test_a_term_registered_outside_the_package_is_weighted_and_trained(registry):
    registry.register(LossTerm(name="hidden_gap", compute=_final_hidden_gap))
    assert "hidden_gap" in registry.hyper_keys() and LossWeights(hidden_gap=2.0)["hidden_gap"] == 2.0
    teacher = tiny_teacher()
    student = student_from(teacher)
    graph, trainable, frozen = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, chunk=8), terms=("hidden_gap",))
    grad_fn = jax.jit(step_lib.make_grad_fn(graph, teacher_graph, settings), compiler_options=FAST_COMPILE)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)), jnp.int32)
    counts = {"tokens": jnp.float32(2 * (LENGTH - 1)), "positions": jnp.float32(2 * LENGTH)}
    results = {}
    for weight in (0.0, 2.0):
        hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, hidden_gap=weight)), 0, 0.0)
        (loss, metrics), grads = grad_fn({"student": trainable, "proj": {}}, frozen, teacher_state,
                                         {"input_ids": ids}, counts, hyper)
        results[weight] = float(loss), {k: float(v) for k, v in metrics.items()}, grads

    t_hidden = teacher(ids, return_logits=False).final_hidden
    s_hidden = student(ids, return_logits=False).final_hidden
    want = float(np.sum(np.square(np.asarray(s_hidden) - np.asarray(t_hidden))) / (2 * LENGTH))
    (loss_0, metrics_0, grads_0), (loss_2, metrics_2, grads_2) = results[0.0], results[2.0]
    assert want > 0 and metrics_2["loss/hidden_gap"] == pytest.approx(want, rel=1e-5)
    assert loss_2 == pytest.approx(loss_0 + 2.0 * want, rel=1e-5)
    assert loss_0 == pytest.approx(metrics_0["term/kl"], rel=1e-6)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(grads_0), jax.tree.leaves(grads_2))]
    assert sum(moved) > len(moved) // 2  # the new term's gradient reaches most student parameters
