"""refit_mlp: each narrowed MLP's down projection refitted by least squares to the teacher's whole MLP, layer by
layer on the student's own inputs; checked against a direct numpy solve of the first layer, the layers' errors
recomputed from the activations, the student's distance to the teacher, and the refusals."""
import numpy as np
import pytest

from nnx_surgery.surgery import ConfigError, ModelConfig, StudentSpec, apply_plan, create_model, plan_student
from nnx_surgery.surgery import logit_distance, refit_mlp

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
EXTRA = {"gemma2": {"query_pre_attn_scalar": 8, "sliding_window": 4}, "llama": {}}
RNG = np.random.default_rng(5)
CALIBRATION = RNG.integers(0, 64, (12, 16))
HELD_OUT = RNG.integers(0, 64, (8, 16))
RIDGE = 1e-2


def teacher(model_type: str):
    config = ModelConfig.from_hf_dict({"model_type": model_type, **SIZES, **EXTRA[model_type]})
    return create_model(config, seed=3)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def first_layer_solution(model, student, plan, rows):
    """The first student layer's refit computed here from the student's forward captures, in float64."""
    out = student(rows, capture=("mlp_inputs", "mlp_activations"), return_logits=False)
    x = np.asarray(out.mlp_inputs[0], np.float64).reshape(-1, student.config.hidden_size)
    h = np.asarray(out.mlp_activations[0], np.float64).reshape(x.shape[0], -1)
    mlp, hidden = model.layers[plan.kept_layers[0]].mlp, np.asarray(plan.kept_hidden)
    gate = x @ np.asarray(mlp.gate_proj.weight[...], np.float64)[:, hidden].T
    up = x @ np.asarray(mlp.up_proj.weight[...], np.float64)[:, hidden].T
    act = gate / (1 + np.exp(-gate)) if model.config.hidden_act == "silu" else gelu_tanh(gate)
    y = (act * up) @ np.asarray(mlp.down_proj.weight[...], np.float64)[hidden].T
    gram = h.T @ h
    w = np.linalg.solve(gram + RIDGE * np.mean(np.diag(gram)) * np.eye(len(gram)), h.T @ y)
    return w, h, y


def refit_and_check_first_layer(model, spec):
    """Refit a student of `spec` cut from `model`; its first layer's weights must be the direct solve's, and its
    reported errors those recomputed from the activations."""
    plan = plan_student(model, spec, calibration=CALIBRATION)
    student = apply_plan(model, plan)
    before = logit_distance(model, student, [HELD_OUT])["kl"]
    want, h, y = first_layer_solution(model, student, plan, CALIBRATION)  # the first layer's inputs do not change
    sliced = np.asarray(student.layers[0].mlp.down_proj.weight[...], np.float64).T

    report = refit_mlp(student, model, plan, CALIBRATION, ridge=RIDGE, batch_size=5)  # batches of 5, 5 and 2 rows

    got = np.asarray(student.layers[0].mlp.down_proj.weight[...], np.float64).T
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    first = report.layers[0]
    assert first.before == pytest.approx(np.sum((h @ sliced - y) ** 2) / np.sum(y ** 2), rel=1e-4)
    assert first.after == pytest.approx(np.sum((h @ got - y) ** 2) / np.sum(y ** 2), rel=1e-3)
    assert [layer.layer for layer in report.layers] == list(range(spec.num_layers))
    assert [layer.teacher_layer for layer in report.layers] == plan.kept_layers
    assert all(layer.after < layer.before for layer in report.layers)
    assert all(layer.kept == spec.intermediate_size for layer in report.layers)
    assert report.tokens == CALIBRATION.size and f"{spec.num_layers} narrowed MLPs" in report.summary()
    return before, logit_distance(model, student, [HELD_OUT])["kl"]  # on rows the fit never saw


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_refit_solves_each_layer_and_brings_the_student_nearer(model_type):
    before, after = refit_and_check_first_layer(teacher(model_type), StudentSpec(3, 32, 16, 4, 2))
    assert after < 0.9 * before


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_refit_after_depth_and_hidden_cuts(model_type):
    """The teacher MLP's target is read on the kept residual channels, layer s against teacher layer
    kept_layers[s]."""
    before, after = refit_and_check_first_layer(teacher(model_type), StudentSpec(2, 24, 16, 2, 1))
    assert after < before


def test_uncut_mlps_are_left_alone():
    model = teacher("gemma2")
    plan = plan_student(model, StudentSpec(3, 32, 48, 4, 2), calibration=CALIBRATION)  # only depth... none cut
    student = apply_plan(model, plan)
    weights = [np.asarray(layer.mlp.down_proj.weight[...]) for layer in student.layers]
    report = refit_mlp(student, model, plan, CALIBRATION)
    assert report.layers == () and "nothing refitted" in report.summary()
    for layer, weight in zip(student.layers, weights):
        np.testing.assert_array_equal(np.asarray(layer.mlp.down_proj.weight[...]), weight)


def test_refusals():
    model = teacher("llama")
    plan = plan_student(model, StudentSpec(3, 32, 16, 4, 2), calibration=CALIBRATION)
    student = apply_plan(model, plan)
    with pytest.raises(ValueError, match="outside the student's vocabulary"):
        refit_mlp(student, model, plan, np.full((2, 4), 64))
    with pytest.raises(ValueError, match=r"\(N, T\)"):
        refit_mlp(student, model, plan, np.zeros(4, int))
    with pytest.raises(ValueError, match="ridge"):
        refit_mlp(student, model, plan, CALIBRATION, ridge=0.0)
    with pytest.raises(ConfigError, match="the model the plan was made on"):
        refit_mlp(student, student, plan, CALIBRATION)
    with pytest.raises(ConfigError, match="plan's student config"):
        refit_mlp(model, model, plan, CALIBRATION)
