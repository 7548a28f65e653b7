"""The logit loss's TPU kernels (nnx_surgery/distill/losses/tpu_kernel.py), run in Pallas' interpreter: loss,
metrics and both gradients equal the XLA fused loss's with and without soft-caps, at a temperature, with CE, CE
alone (no teacher), rows that the row block does not divide and a frozen head; settings the kernels do not
compute are left to the XLA loss; a train step with logit_impl="kernel" gives the fused step's loss and
gradients; DistillConfig names the choices. On the chip itself: tests/tpu/test_on_chip.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss
from nnx_surgery.distill.losses.tpu_kernel import UNKNOWN, kernel_applies, kernel_logit_loss, logit_softcap

B, T, D, DT, V = 2, 100, 32, 48, 384  # 200 rows: two 128-row blocks, the second padded; three 128-wide vocab tiles


def logits_fn(cap):
    def f(h, w):
        z = jnp.einsum("...D,VD->...V", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
        return z if cap is None else cap * jnp.tanh(z / cap)
    return f


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    h_s = jax.random.normal(keys[0], (B, T, D)) * 2
    head_s = jax.random.normal(keys[1], (V, D))
    h_t = jax.random.normal(keys[2], (B, T, DT)) * 2
    head_t = jax.random.normal(keys[3], (V, DT))
    labels = jax.random.randint(keys[4], (B, T), 0, V)
    weights = jax.random.uniform(keys[5], (B, T)) * (jnp.arange(T) < T - 1) / (B * (T - 1))
    return h_s, head_s, h_t, head_t, labels, weights


def loss_and_grads(kind, spec, caps, coeffs, teacher=True, argnums=(0, 1)):
    h_s, head_s, h_t, head_t, labels, weights = inputs()
    h_t, head_t = (h_t, head_t) if teacher else (None, None)

    def f(h_s, head_s):
        if kind == "kernel":
            return kernel_logit_loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, caps=caps, spec=spec,
                                     interpret=True, row_block=128)
        return fused_logit_loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, student_logits=logits_fn(caps[0]),
                                teacher_logits=logits_fn(caps[1]) if teacher else None, spec=spec)

    (loss, metrics), grads = jax.value_and_grad(f, argnums=argnums, has_aux=True)(h_s, head_s)
    grads = grads if isinstance(argnums, tuple) else (grads,)
    return float(loss), {k: float(v) for k, v in metrics.items()}, [np.asarray(g) for g in grads]


CASES = {  # name: (spec, caps, coeffs, with a teacher)
    "kl": (LogitLossSettings(kl=True, unit_temperature=True, chunk=64), (None, None),
           {"temperature": 1.0, "kl": 1.0, "ce": 0.0}, True),
    "kl_ce_tau2_capped": (LogitLossSettings(kl=True, ce=True, chunk=64), (30.0, 50.0),
                          {"temperature": 2.0, "kl": 0.7, "ce": 0.3}, True),
    "kl_ce_unit_capped": (LogitLossSettings(kl=True, ce=True, unit_temperature=True, chunk=64), (15.0, 15.0),
                          {"temperature": 1.0, "kl": 0.5, "ce": 0.5}, True),
    "ce_alone": (LogitLossSettings(kl=False, ce=True, teacher=False, chunk=64), (30.0, None),
                 {"temperature": 1.0, "kl": 0.0, "ce": 1.0}, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernels_give_the_fused_losss_values_and_gradients(name):
    spec, caps, coeffs, teacher = CASES[name]
    got = loss_and_grads("kernel", spec, caps, coeffs, teacher)
    want = loss_and_grads("fused", spec, caps, coeffs, teacher)
    assert got[0] == pytest.approx(want[0], rel=2e-5)
    assert sorted(got[1]) == sorted(want[1])
    assert got[1] == pytest.approx(want[1], rel=2e-5)
    for g, w in zip(got[2], want[2]):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * float(np.abs(w).max()))


def test_a_frozen_head_gets_no_gradient_and_the_same_hidden_gradient():
    spec, caps, coeffs, teacher = CASES["kl_ce_tau2_capped"]
    got = loss_and_grads("kernel", spec, caps, coeffs, teacher, argnums=0)
    want = loss_and_grads("fused", spec, caps, coeffs, teacher, argnums=0)
    np.testing.assert_allclose(got[2][0], want[2][0], rtol=1e-4, atol=2e-5 * float(np.abs(want[2][0]).max()))


def test_settings_the_kernels_do_not_compute_are_left_to_the_xla_loss():
    plain = LogitLossSettings(kl=True)
    assert kernel_applies(plain, False, 262144, (None, 30.0))
    assert not kernel_applies(plain, False, 262145, (None, None))  # not whole 128-lane tiles
    assert not kernel_applies(plain, False, 1024, (UNKNOWN, None))  # a soft-cap the model does not state
    assert not kernel_applies(plain, True, 1024, (None, None))  # a cached teacher's top k
    for other in (dict(top_k=8), dict(jsd=True), dict(reverse_kl=True), dict(diagnostics=True)):
        assert not kernel_applies(LogitLossSettings(kl=True, **other), False, 1024, (None, None)), other


def test_the_soft_cap_is_read_from_the_models_config():
    from distill_fixtures import tiny_teacher

    assert logit_softcap(tiny_teacher()) == 15.0
    assert logit_softcap(type("NoCap", (), {"config": type("C", (), {"final_logit_softcapping": None})()})()) is None
    assert logit_softcap(object()) is UNKNOWN


def test_distill_config_names_the_logit_losses():
    for impl in ("fused", "fused_xla", "kernel"):
        assert DistillConfig(stages=(Stage(steps=1),), logit_impl=impl).logit_impl == impl
    with pytest.raises(ValueError, match="'fused', 'fused_xla', 'kernel', 'two_pass', 'reference'"):
        DistillConfig(stages=(Stage(steps=1),), logit_impl="pallas")


def test_a_train_step_with_the_kernels_gives_the_fused_steps_loss_and_gradients():
    import nnx_surgery.distill.loop.train_step as step_lib
    from nnx_surgery.surgery.modeling.causal_lm import create_model
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from distill_fixtures import LENGTH, step_gradients, tiny_config

    vocab = 128  # the fixtures' 96 is not whole 128-lane tiles
    sized = lambda layers: ModelConfig.from_hf_dict({**tiny_config(layers).to_hf_dict(), "vocab_size": vocab})
    teacher, student = create_model(sized(3), seed=0), create_model(sized(2), seed=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (2, LENGTH)).astype(np.int32))

    def run(impl):
        settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8), logit_impl=impl)
        return step_gradients(teacher, student, settings, ids)

    want, got = run("fused"), run("kernel_interpret")
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-6)
    assert sorted(got[2]) == sorted(want[2])
    for path, w in want[2].items():
        np.testing.assert_allclose(got[2][path], w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()), err_msg=path)


def test_a_runs_first_step_records_which_logit_loss_it_compiled(tmp_path):
    """`logit_loss` in the history of the step that compiled: "kernels" where the kernels ran (forced here, in
    the interpreter), "fused" for the XLA loss (the default off a TPU), and "fused" again where the kernels do not
    apply (a vocabulary of 96 is not whole 128-lane tiles)."""
    from nnx_surgery.distill.loop.trainer import run
    from nnx_surgery.surgery.modeling.causal_lm import create_model
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, ArrayBatches, tiny_config

    def first_record(vocab, impl):
        sized = lambda layers: ModelConfig.from_hf_dict({**tiny_config(layers).to_hf_dict(), "vocab_size": vocab})
        teacher, student = create_model(sized(3), seed=0), create_model(sized(2), seed=1)
        ids = np.random.default_rng(0).integers(0, vocab, (BATCH, LENGTH)).astype(np.int32)
        config = DistillConfig(stages=(Stage(steps=1, weights=LossWeights(kl=1.0)),), batch_size=BATCH,
                               seq_len=LENGTH, progress=False, plots=False, logit_impl=impl,
                               run_dir=str(tmp_path / f"{vocab}-{impl}"), compiler_options=FAST_COMPILE)
        return run(teacher, student, ArrayBatches([{"input_ids": ids}]), config).history[0]

    assert first_record(128, "kernel")["logit_loss"] == "kernels"
    assert first_record(128, "fused")["logit_loss"] == "fused"
    assert first_record(96, "kernel")["logit_loss"] == "fused"
