"""Fallbacks when distillation goes wrong (nnx_surgery/distill/loop/fallbacks.py): `switch_to_mse` after a divergence caused by a
corrupted batch the test injects, `sft_then_mix` when a misleading teacher makes the held-out cross-entropy worse;
each switch is an event with its reason, changes only traced weights (no recompilation) and survives a resume."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.distill import terms
from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, GuardConfig, LossWeights, Stage
from nnx_surgery.distill.loop.fallbacks import Fallbacks, mixed_weights
from nnx_surgery.distill.losses.term_types import LossTerm, ModelSide, TermInputs
from nnx_surgery.distill.losses.mse import logit_mse
from nnx_surgery.distill.loop.trainer import run
from distill_fixtures import (BATCH, FAST_COMPILE, LENGTH, ArrayBatches, params_numpy, student_from, teacher_samples,
                              tiny_teacher)

CORRUPT_AT = 4  # index of the batch whose NaN loss mask makes step 5 diverge


@pytest.fixture(scope="module")
def corpus():
    batches = teacher_samples(tiny_teacher(), 20, seed=3)
    return {"train": batches[:16], "eval": batches[16:]}


def corrupted(batches):
    out = [{**b, "loss_mask": np.ones((BATCH, LENGTH), np.float32)} for b in batches]
    out[CORRUPT_AT] = {**out[CORRUPT_AT], "loss_mask": np.full((BATCH, LENGTH), np.nan, np.float32)}
    return out


def config(**changes):
    base = dict(stages=(Stage(steps=8, learning_rate=5e-3, weights=LossWeights.mixed(0.8)),), batch_size=BATCH,
                seq_len=LENGTH, progress=False, logit_chunk=16, compiler_options=FAST_COMPILE,
                checkpoint=CheckpointConfig(every=2),
                guard=GuardConfig(policies=("switch_to_mse",), mse_steps=3, mse_weight=5.0, min_history=2))
    return DistillConfig(**{**base, **changes})


@contextlib.contextmanager
def step_compilations():
    """Names of the XLA compilations made inside the block (the train step compiles as "jit(step)")."""
    names = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def fallback_events(result, action=None):
    return [e for e in result.full_events if e["event"] == "fallback" and action in (None, e["action"])]


def test_mixing_and_the_policy_state_machine():
    weights = {"kl": 0.8, "reverse_kl": 0.0, "jsd": 0.0, "ce": 0.2, "attention": 0.0, "feature": 0.4, "mse": 0.0}
    assert mixed_weights(weights, 0.0) == {**dict.fromkeys(weights, 0.0), "ce": 1.0}
    # KD = the teacher-side weights with the divergences scaled to sum to 1: kl 1.0, feature 0.4
    assert mixed_weights(weights, 0.5) == pytest.approx({**dict.fromkeys(weights, 0.0), "kl": 0.5, "feature": 0.2,
                                                         "ce": 0.5})
    guard = GuardConfig(policies=("switch_to_mse", "sft_then_mix"), mse_steps=2, mse_weight=3.0, sft_steps=2,
                        sft_ramp_steps=2, sft_alpha=0.5, sft_patience=2)
    policy = Fallbacks(guard, has_teacher=True)
    with pytest.raises(ValueError, match="nothing to fall back from"):
        Fallbacks(guard, has_teacher=False)
    assert policy.on_evaluation(0, 0, {"student_ce": 2.0}) == []  # the stage's baseline
    assert policy.on_evaluation(2, 0, {"student_ce": 2.1}) == []  # worse once: patience 2
    (message, fields), = policy.on_evaluation(4, 0, {"student_ce": 2.2})
    assert fields["action"] == "start" and "2.2 worse than 2" in fields["reason"]
    assert [policy.weights(weights, step)[0]["kl"] for step in range(4, 9)] == pytest.approx([0, 0, 0.25, 0.5, 0.5])
    assert [policy.weights(weights, step)[0]["ce"] for step in range(4, 9)] == pytest.approx([1, 1, 0.75, 0.5, 0.5])
    assert [f["action"] for s in range(5, 10) for _, f in policy.on_step(s)] == ["ramp", "mixed"]
    (_, fields), = policy.on_divergence(restored_step=6, reason="loss nan")
    assert fields["until_step"] == 8 and policy.weights(weights, 7) == (
        {**mixed_weights(weights, 0.5), "mse": 3.0}, ["sft_then_mix", "switch_to_mse"])
    restored = Fallbacks(guard, has_teacher=True)
    restored.restore(policy.state())
    assert restored.state() == policy.state() and restored.weights(weights, 7) == policy.weights(weights, 7)
    (_, fields), = policy.on_stage(1)
    assert fields["action"] == "end" and policy.weights(weights, 9) == (weights, [])
    assert policy.on_evaluation(9, 1, {"student_ce": 9.0}) == []  # a new baseline for the new stage


def test_sft_then_mix_needs_held_out_evaluations(corpus):
    with pytest.raises(ValueError, match="pass eval_data .* and set eval_every"):
        run(tiny_teacher(), student_from(tiny_teacher()), corpus["train"],
            config(guard=GuardConfig(policies=("sft_then_mix",))), eval_data=corpus["eval"])  # eval_every unset


def test_logit_mse_is_the_mean_squared_difference_of_centred_logits():
    rng = np.random.default_rng(0)
    model = type("Head", (), {"logits_from_hidden": staticmethod(lambda h, w: h @ w.T)})()
    hidden = [jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32) for _ in range(2)]
    heads = [jnp.asarray(rng.normal(size=(7, 4)), jnp.float32) for _ in range(2)]
    weights = jnp.asarray(rng.random((2, 5)), jnp.float32)
    inputs = TermInputs(teacher=ModelSide(hidden[0], heads[0], {}, model),
                        student=ModelSide(hidden[1], heads[1], {}, model), labels=None, token_weights=weights,
                        query_weights=None, correspondence=None, projections=None, hyper={}, settings=None)
    t, s = (np.asarray(h) @ np.asarray(w).T for h, w in zip(hidden, heads))
    t, s = t - t.mean(-1, keepdims=True), s - s.mean(-1, keepdims=True)
    want = np.sum(np.asarray(weights) * ((s - t) ** 2).mean(-1))
    assert float(logit_mse(inputs, chunk=4)) == pytest.approx(want, rel=1e-5)  # 10 rows in chunks of 4 (padded)


def test_switch_to_mse_after_a_corrupted_batch_without_recompiling(corpus):
    with step_compilations() as compiled:
        result = run(tiny_teacher(), student_from(tiny_teacher()), corrupted(corpus["train"]), config())
    # one rollback: the spike check (armed after 2 steps here) restarts its history when the weights switch, so
    # the jump the MSE term brings (loss ~1.1 -> ~7, over 4 x the median) is not taken for a divergence
    rollback, = [e for e in result.events if e["event"] == "rollback"]
    assert rollback["failed_step"] == 5 and rollback["restored_step"] == 4
    start, end = fallback_events(result, "start")[0], fallback_events(result, "end")[0]
    assert start["policy"] == "switch_to_mse" and start["reason"].startswith("divergence: non-finite loss")
    assert start["until_step"] == 7 and end["step"] == 7
    on = [r for r in result.history if r.get("fallback") == "switch_to_mse"]
    assert [r["step"] for r in on] == [5, 6, 7] and all(r["weight/mse"] == 5.0 for r in on)
    assert all(r["loss/mse"] > 0.5 for r in on)  # measured 1.2
    off = [r for r in result.history if r["step"] not in (5, 6, 7)]
    assert all(r["loss/mse"] == 0 and "fallback" not in r for r in off)
    # loss = term sum: with the MSE on, the total carries 5 x its value
    assert on[0]["loss"] == pytest.approx(on[0]["loss/logit"] + 5.0 * on[0]["loss/mse"], rel=1e-5)
    assert on[0]["loss"] > 4 * max(r["loss"] for r in result.history[:4])
    assert compiled.count("jit(step)") == 1, compiled  # switching on and off changed traced weights only
    assert all(np.isfinite(v).all() for v in params_numpy(result.student).values())


def test_a_run_interrupted_inside_the_mse_fallback_resumes_inside_it(corpus, tmp_path):
    batches = corrupted(corpus["train"])
    reference = student_from(tiny_teacher())
    full = run(tiny_teacher(), reference, ArrayBatches(batches),
               config(checkpoint=CheckpointConfig(str(tmp_path / "a"), every=1)))
    halted = run(tiny_teacher(), student_from(tiny_teacher()), ArrayBatches(batches),
                 config(checkpoint=CheckpointConfig(str(tmp_path / "b"), every=1), halt_after=6))
    assert halted.steps == 6 and halted.history[-1]["fallback"] == "switch_to_mse"
    fresh = student_from(tiny_teacher(seed=5))
    resumed = run(tiny_teacher(), fresh, ArrayBatches(batches),
                  config(checkpoint=CheckpointConfig(str(tmp_path / "b"), every=1)))
    assert [r["step"] for r in resumed.history] == [7, 8]
    assert resumed.history[0]["fallback"] == "switch_to_mse" and "fallback" not in resumed.history[1]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[-2:]]
    assert [e["action"] for e in fallback_events(resumed)] == ["start", "end"]  # the start from the checkpoint
    want, got = params_numpy(reference), params_numpy(fresh)
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_sft_then_mix_when_a_misleading_teacher_worsens_held_out_cross_entropy(corpus):
    """The data and the student come from one teacher, the distillation from another: the held-out student CE
    gets worse than at the stage's start, so the run falls back to pure CE, then ramps the KL back to alpha; it
    ends with a lower held-out CE than the same run without the fallback."""
    stages = (Stage(steps=12, learning_rate=1e-2, weights=LossWeights(kl=1.0)),)
    results = {}
    for policies in (("sft_then_mix",), ()):
        guard = GuardConfig(policies=policies, sft_steps=4, sft_ramp_steps=2, sft_alpha=0.5)
        with step_compilations() as compiled:
            results[policies] = run(tiny_teacher(seed=7), student_from(tiny_teacher()), corpus["train"],
                                    config(stages=stages, guard=guard, eval_every=2), eval_data=corpus["eval"])
        assert compiled.count("jit(step)") <= 1, compiled  # the switches changed traced weights only
    result, control = results[("sft_then_mix",)], results[()]
    evals = {r["step"]: r["student_ce"] for r in result.evals}
    start, = fallback_events(result, "start")
    assert start["step"] == 4 and evals[4] > evals[0] and evals[2] <= evals[0], evals  # measured 3.633 -> 3.695
    assert "held-out student_ce 3.69" in start["reason"] and "worse than 3.63" in start["reason"]
    assert [(e["step"], e["action"]) for e in fallback_events(result)] == [(4, "start"), (8, "ramp"), (10, "mixed")]
    weights = [(r["weight/kl"], r["weight/ce"]) for r in result.history if r["step"] > 4]
    assert weights == [(0, 1)] * 4 + [(0.25, 0.75)] + [(0.5, 0.5)] * 3
    assert all("fallback" not in r for r in result.history[:4]) and not fallback_events(control)
    assert evals[12] < control.evals[-1]["student_ce"] - 0.05  # measured 3.714 against 3.815


def test_switch_to_mse_on_mapped_features(corpus):
    """The MSE term's option on="features": the MSE compares the teacher's and student's mapped layer outputs (the uniform layer
    map of a 4 -> 2 layer student), also when no stage weights a layer-output loss."""
    guard = GuardConfig(policies=("switch_to_mse",), mse_steps=2, mse_weight=0.5)
    result = run(tiny_teacher(), student_from(tiny_teacher()), corrupted(corpus["train"][:8]),
                 config(stages=(Stage(steps=6, learning_rate=5e-3, weights=LossWeights.mixed(0.8)),), guard=guard,
                        loss_options={"mse": {"on": "features"}}))
    on = [r for r in result.history if r.get("fallback") == "switch_to_mse"]
    assert [r["step"] for r in on] == [5, 6] and all(r["loss/mse"] > 0 for r in on)
    assert fallback_events(result, "start")[0]["on"] == "features"
    assert on[0]["loss"] == pytest.approx(on[0]["loss/logit"] + 0.5 * on[0]["loss/mse"], rel=1e-5)


def test_a_run_interrupted_during_sft_then_mix_resumes_inside_it(corpus, tmp_path):
    stages = (Stage(steps=12, learning_rate=1e-2, weights=LossWeights(kl=1.0)),)
    guard = GuardConfig(policies=("sft_then_mix",), sft_steps=4, sft_ramp_steps=2, sft_alpha=0.5)

    def go(directory, **changes):
        return run(tiny_teacher(seed=7), student_from(tiny_teacher()), ArrayBatches(corpus["train"]),
                   config(stages=stages, guard=guard, eval_every=2, checkpoint=CheckpointConfig(directory, every=1),
                          **changes), eval_data=corpus["eval"])

    full = go(str(tmp_path / "a"))
    halted = go(str(tmp_path / "b"), halt_after=6)  # two steps into the four of pure cross-entropy
    assert halted.history[-1]["fallback"] == "sft_then_mix"
    resumed = go(str(tmp_path / "b"))
    want = [(r["step"], r["weight/kl"], r["weight/ce"], r["loss"]) for r in full.history[6:]]
    assert [(r["step"], r["weight/kl"], r["weight/ce"], r["loss"]) for r in resumed.history] == want
    assert [e["action"] for e in fallback_events(resumed)] == ["start", "ramp", "mixed"]
    assert fallback_events(resumed, "start")[0] in resumed.resumed_events


def test_the_mse_fallback_is_an_ordinary_term_switched_by_weights(corpus, monkeypatch):
    """The MSE term declares its fallback role (switch_to_mse moves its weight); the fallback only raises that
    weight, for any term declaring the role, and compiles it in as a stage weighting it would. A stage may
    weight the MSE term itself, with no policy: it trains like any term."""
    assert terms.fallback_weights(("switch_to_mse",)) == ("mse",)
    assert terms.fallback_weights(("sft_then_mix",)) == ("ce",)  # the logit term's CE kind
    stage_weights = LossWeights.mixed(0.8)
    compiled = terms.compiled_weights(stage_weights, ("switch_to_mse",))
    assert compiled == {**stage_weights.as_dict(), "mse": 1.0}
    assert [t.name for t in terms.active_terms(compiled)] == ["logit", "mse"]
    monkeypatch.setattr(terms, "_REGISTRY", dict(terms._REGISTRY))
    terms.register(LossTerm(name="other_aux", compute=lambda inputs: 0.0, fallbacks={"switch_to_mse": ("other_aux",)}))
    policy = Fallbacks(GuardConfig(policies=("switch_to_mse",), mse_weight=2.0), has_teacher=True)
    policy.on_divergence(restored_step=0, reason="test")
    weights, active = policy.weights(LossWeights.mixed(0.8, other_aux=0.5), 0)
    assert (weights["mse"], weights["other_aux"], active) == (2.0, 2.5, ["switch_to_mse"])
    monkeypatch.undo()

    stage = Stage(steps=3, learning_rate=5e-3, weights=LossWeights.mixed(0.8, mse=0.5))
    result = run(tiny_teacher(), student_from(tiny_teacher()), corpus["train"],
                 config(stages=(stage,), guard=GuardConfig()))
    assert all(r["loss/mse"] > 0 and "fallback" not in r for r in result.history)
    assert all(r["loss"] == pytest.approx(r["loss/logit"] + 0.5 * r["loss/mse"], rel=1e-5) for r in result.history)
