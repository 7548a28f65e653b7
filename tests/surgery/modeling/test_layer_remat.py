"""Per-layer rematerialisation (`remat="layers"` / `"layers_dots"`, nnx_surgery/surgery/modeling/layer_remat.py): the train
step's loss, metrics and gradients are those of no remat and of the whole-forward remat, with the attention and
feature terms reading captured intermediates; every capture comes out unchanged; and the compiled backward pass
needs clearly fewer temporaries than without remat, where the whole-forward checkpoint saves nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, OOMConfig, Stage
from nnx_surgery.distill.loop.freeze import path_string, split_trainable
from nnx_surgery.distill.interface import Correspondence
from nnx_surgery.distill.losses.divergence import LogitLossSettings
from nnx_surgery.distill.loop.oom import MemoryPlan
from nnx_surgery.surgery.modeling.causal_lm import CAPTURABLE, create_model
from distill_fixtures import FAST_COMPILE, LENGTH, VOCAB, student_from, tiny_config, tiny_teacher

WEIGHTS = LossWeights(kl=1.0, ce=0.5, attention=1.0, feature=1.0)
HYPER = step_lib.hyper_values(Stage(steps=1, weights=WEIGHTS, temperature=2.0), 0, 0.0)
COUNTS = {"tokens": jnp.float32(2 * (LENGTH - 1)), "positions": jnp.float32(2 * LENGTH)}


@pytest.fixture(scope="module")
def models():
    teacher = tiny_teacher()
    return teacher, student_from(teacher)


def _step_gradients(teacher, student, remat):
    """(loss, metrics, {path: gradient}) of one micro-batch with the logit, attention and feature terms."""
    graph, trainable, rest = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8),
                                     terms=("attention", "feature"),
                                     correspondence=Correspondence(layer_map=((0, 0), (3, 1))), remat=remat)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)).astype(np.int32))
    run = jax.jit(step_lib.make_grad_fn(graph, teacher_graph, settings), compiler_options=FAST_COMPILE)
    (loss, metrics), grads = run({"student": trainable, "proj": {}}, rest, teacher_state, {"input_ids": ids},
                                 COUNTS, HYPER)
    flat = {path_string(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads["student"])}
    return float(loss), {k: float(v) for k, v in metrics.items()}, flat


def test_step_loss_metrics_and_gradients_equal_across_remat(models):
    teacher, student = models
    loss, metrics, grads = _step_gradients(teacher, student, None)
    assert metrics["loss/attention"] > 0 and metrics["loss/feature"] > 0  # the captures are in use
    for remat in ("layers", "layers_dots", "full"):
        got_loss, got_metrics, got = _step_gradients(teacher, student, remat)
        assert got_loss == pytest.approx(loss, rel=1e-6), remat
        assert got_metrics == pytest.approx(metrics, rel=1e-6), remat
        assert sorted(got) == sorted(grads)
        for path in grads:
            # Remat reorders float32 sums: an element far below its tensor's scale (a cancellation) may differ in
            # its fifth digit, so the absolute tolerance follows the tensor's largest gradient.
            scale = float(np.abs(grads[path]).max())
            np.testing.assert_allclose(got[path], grads[path], rtol=1e-5, atol=1e-5 * scale,
                                       err_msg=f"{remat} {path}")


def test_every_capture_comes_out_unchanged_and_bad_uses_are_refused(models):
    _, student = models
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH)).astype(np.int32))
    graph, state = nnx.split(student)

    @jax.jit
    def forward(state, remat):
        out = nnx.merge(graph, state)(ids, capture=CAPTURABLE, remat=remat)
        return {name: getattr(out, name) for name in (*CAPTURABLE, "logits")}

    want = forward(state, None)
    for remat in ("layers", "layers_dots"):
        got = jax.jit(lambda s: nnx.merge(graph, s)(ids, capture=CAPTURABLE, remat=remat))(state)
        for name, values in want.items():
            values = values if isinstance(values, tuple) else (values,)
            mine = getattr(got, name)
            mine = mine if isinstance(mine, tuple) else (mine,)
            assert len(mine) == len(values), name
            for a, b in zip(mine, values):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{remat} {name}")
    with pytest.raises(ValueError, match="unknown"):
        student(ids, remat="full")  # a whole-forward remat is the step's, not the model's
    with pytest.raises(ValueError, match="cache"):
        student(ids, remat="layers", cache=student.init_cache(2, LENGTH))


def _temporaries(remat, layers=4, length=128):
    """Compiled temporaries of value_and_grad of a stand-in loss over a student of `layers` layers."""
    model = create_model(tiny_config(layers), seed=0)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.ShapeDtypeStruct((2, length), jnp.int32)
    settings_remat = remat if remat in step_lib.LAYER_REMAT else None

    def loss(params, ids):
        out = nnx.merge(graph, params, rest)(ids, return_logits=False, remat=settings_remat)
        return jnp.sum(out.final_hidden ** 2)

    loss = step_lib._rematerialised(loss, remat)
    lowered = jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE).lower(params, ids)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_layer_remat_lowers_compiled_temporaries():
    none, layers, full = _temporaries(None), _temporaries("layers"), _temporaries("full")
    assert layers < 0.5 * none  # one layer's activations at a time, plus the residual stream
    assert full > 0.8 * none  # the whole-forward checkpoint recomputes everything, then holds it all
    assert _temporaries("layers_dots") < none


def test_the_configuration_and_the_oom_ladder_accept_layer_remat():
    for remat in ("layers", "layers_dots"):
        assert DistillConfig(remat=remat).remat == remat
    with pytest.raises(ValueError, match="layers"):
        DistillConfig(remat="layer")
    assert OOMConfig(sequence=("layers", "halve_batch")).sequence == ("layers", "halve_batch")
    # "layers" saves more than either whole-forward remat at the cost of "full": once in force, they are skipped
    plan = MemoryPlan(remat="layers")
    assert plan.next_action(("dots", "full", "layers", "halve_batch"), micro_batch=2, data_split=1) == "halve_batch"
    plan = MemoryPlan(remat=None)
    assert plan.next_action(OOMConfig().sequence, micro_batch=2, data_split=1) == OOMConfig().sequence[0]
