"""Loss terms as objects: weights keyed by registered names, the step's hyperparameters and switches derived from
the registry, options declared on the terms, and a term defined outside the package (with an option) trained
after one `register` call, with its recipe flag."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill import terms
from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, Stage
from nnx_surgery.distill.loop.freeze import split_trainable
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.distill.losses.term_types import LossTerm, TermInputs, TermOption
from nnx_surgery.distill.loop.trainer import run
from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, VOCAB, student_from, teacher_samples, tiny_teacher

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


def _scaled_gap(inputs: TermInputs) -> jax.Array:
    """The final-hidden-state gap times the term's own option `scale`."""
    return inputs.options["scale"] * _final_hidden_gap(inputs)


SCALED_GAP = LossTerm(name="scaled_gap", compute=_scaled_gap, options=(TermOption("scale", 1.0),),
                      flag="the scaled final-hidden-state gap (0: off)")


def test_a_term_with_an_option_is_one_registration(registry, monkeypatch):
    """A term with its own option, defined here: one `register` call makes its option a DistillConfig setting
    (checked against the declaration), trains it with that option in `distill.run`, and gives the recipe a
    weight flag for it."""
    registry.register(SCALED_GAP)
    with pytest.raises(ValueError, match=r"has no option\(s\) \['scal'\]; its options: scale"):
        DistillConfig(loss_options={"scaled_gap": {"scal": 2.0}})
    with pytest.raises(ValueError, match="no loss term 'scaled_gapp'"):
        DistillConfig(loss_options={"scaled_gapp": {"scale": 2.0}})
    teacher = tiny_teacher()
    batches = teacher_samples(teacher, 1, seed=1)
    stage = Stage(steps=1, learning_rate=1e-3, weights=LossWeights(kl=1.0, scaled_gap=2.0))
    config = DistillConfig(stages=(stage,), batch_size=BATCH, seq_len=LENGTH, progress=False, logit_chunk=16,
                           compiler_options=FAST_COMPILE, loss_options={"scaled_gap": {"scale": 3.0}})
    assert DistillConfig.from_dict(config.to_dict()) == config
    student = student_from(teacher)
    ids = jnp.asarray(batches[0]["input_ids"])
    gap = np.sum(np.square(np.asarray(student(ids, return_logits=False).final_hidden)
                           - np.asarray(teacher(ids, return_logits=False).final_hidden))) / ids.size
    record, = run(teacher, student, batches, config).history
    assert record["loss/scaled_gap"] == pytest.approx(3.0 * gap, rel=1e-4)  # the metric before the update
    assert record["loss"] == pytest.approx(record["loss/logit"] + 2.0 * record["loss/scaled_gap"], rel=1e-5)

    from nnx_surgery.recipes.compress import phase_configs
    from nnx_surgery.recipes.config import command_line
    from nnx_surgery.recipes.compress import resolution

    flags = {name for action in command_line.build_recipe_parser()._actions for name in action.option_strings}
    assert {"--scaled-gap-weight", "--feature-weight", "--cosine-weight", "--attention-weight",
            "--feature-kind"} <= flags and "--mse-weight" not in flags  # the MSE term has no recipe flag
    config = resolution.resolve(["--preset", "tiny", "--scaled-gap-weight", "0.5"])
    assert config.training.term_weights["scaled_gap"] == 0.5
    assert phase_configs.loss_weights(config).scaled_gap == 0.5


def test_options_live_on_the_terms_and_reach_the_step():
    """The built-in terms' options: declared on the term, held only in `loss_options` (an older config's
    feature_kind / guard.mse_on read into it), checked when the config is made, and compiled into the step
    settings."""
    assert not any(f.name in ("feature_kind", "mse_on") for kind in (DistillConfig, GuardConfig)
                   for f in dataclasses.fields(kind))  # one place for each option
    config = DistillConfig(loss_options={"feature": {"kind": "cosine"}, "mse": {"chunk": 64}})
    assert terms.option_values(terms.term("feature"), config) == {"kind": "cosine"}
    assert terms.option_values(terms.term("mse"), config) == {"on": "logits", "chunk": 64}
    older = DistillConfig.from_dict({"feature_kind": "pooled", "loss_options": {"feature": {"kind": "mse"}}})
    assert terms.option_values(terms.term("feature"), older) == {"kind": "mse"}  # loss_options wins, as it did
    assert DistillConfig.from_dict({"feature_kind": "pooled"}).loss_options == {"feature": {"kind": "pooled"}}
    with pytest.raises(ValueError, match="option kind='max'"):
        DistillConfig(loss_options={"feature": {"kind": "max"}})
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True), terms=("feature", "mse"),
                                     options={"mse": {"on": "features"}})
    assert settings.options_of(terms.term("feature")) == {"kind": "nmse"}  # the default
    assert settings.captures == ("residual",) and hash(settings) == hash(
        step_lib.StepSettings(logit=LogitLossSettings(kl=True), terms=("feature", "mse"),
                              options={"mse": {"on": "features"}}))
    assert step_lib.StepSettings(logit=LogitLossSettings(kl=True), terms=("mse",)).captures == ()
