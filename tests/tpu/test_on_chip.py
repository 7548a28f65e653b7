"""On a TPU chip (the `tpu` marker: skipped where JAX has no TPU, as in CI): the splash attention kernel against
the XLA path, the fused logit loss and the logit kernels against the CPU's XLA loss, the kernels' temporaries and
the XLA loss's bounded by its chunk, XLA's compiled memory against the chip's own counters (the tiny recipe on the
chip: test_recipe_on_chip.py). Run them with `make test-tpu`."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss
from nnx_surgery.distill.losses.logit_term import DEFAULT_LOGIT_BLOCK, accelerator_logit_chunk
from nnx_surgery.surgery.modeling.causal_lm import create_model
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.positions import segment_positions

pytestmark = pytest.mark.tpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _softcapped(hidden, head):
    z = jnp.einsum("...D,VD->...V", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return jnp.tanh(z / 30.0) * 30.0


def _loss_grad(batch: int, length: int, vocab: int, width: int, chunk: int):
    spec = LogitLossSettings(kl=True, ce=True, chunk=chunk, block=max(chunk, DEFAULT_LOGIT_BLOCK),
                             unit_temperature=True)

    def loss(hs, head_s, ht, head_t, labels, weights):
        coeffs = {"kl": 0.5, "ce": 0.5, "temperature": 1.0}
        return fused_logit_loss(hs, head_s, ht, head_t, labels, weights, coeffs, student_logits=_softcapped,
                                teacher_logits=_softcapped, spec=spec)[0]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _loss_inputs(b: int, t: int, v: int, d: int) -> tuple:
    """(hs, head_s, ht, head_t, labels, weights): bf16 hidden states, a float32 student head, a bf16 teacher head."""
    rng = np.random.default_rng(0)
    hs, ht = (jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16) for _ in range(2))
    head_s, head_t = (jnp.asarray(rng.normal(size=(v, d)) * 0.1, dtype) for dtype in (jnp.float32, jnp.bfloat16))
    labels = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    return hs, head_s, ht, head_t, labels, jnp.full((b, t), 1.0 / (b * t), jnp.float32)


def test_fused_loss_on_the_chip_matches_the_cpu_at_bf16_tolerance():
    b, t, v, d = 2, 512, 32768, 256
    args = _loss_inputs(b, t, v, d)
    tpu_value, tpu_grads = _loss_grad(b, t, v, d, 256)(*args)
    cpu = jax.devices("cpu")[0]
    cpu_value, cpu_grads = _loss_grad(b, t, v, d, 256)(*jax.device_put(args, cpu))
    np.testing.assert_allclose(float(tpu_value), float(cpu_value), rtol=1e-2)
    for got, want in zip(tpu_grads, cpu_grads):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_the_loss_temporaries_grow_with_the_chunk_not_the_batch():
    """The 270M pair's head (262,144 x 640): XLA's temporaries of the loss's value and gradient at 16k tokens stay
    under 1.5 GB with 256-row chunks, four times the tokens add under 0.2 GB at 256 and at 512 rows (the chunk the
    run picks on a v5e), so no (B x T, V) buffer exists."""
    temps = {}
    for chunk in (256, accelerator_logit_chunk(jax.devices()[0].memory_stats()["bytes_limit"])):
        for batch in (8, 32):
            shapes = [((batch, 2048, 640), jnp.bfloat16), ((262144, 640), jnp.float32),
                      ((batch, 2048, 640), jnp.bfloat16), ((262144, 640), jnp.bfloat16), ((batch, 2048), jnp.int32),
                      ((batch, 2048), jnp.float32)]
            arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
            compiled = _loss_grad(batch, 2048, 262144, 640, chunk).lower(*arguments).compile()
            temps[chunk, batch] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[256, 8] <= 1.5e9, temps
    assert all(temps[chunk, 32] - temps[chunk, 8] <= 0.2e9 for chunk, _ in temps), temps


def _kernel_loss_grad(caps=(30.0, 30.0)):
    from nnx_surgery.distill.losses.tpu_kernel import kernel_logit_loss

    spec = LogitLossSettings(kl=True, ce=True, unit_temperature=True)

    def loss(hs, head_s, ht, head_t, labels, weights):
        coeffs = {"kl": 0.5, "ce": 0.5, "temperature": 1.0}
        return kernel_logit_loss(hs, head_s, ht, head_t, labels, weights, coeffs, caps=caps, spec=spec)[0]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def test_the_logit_kernels_on_the_chip_match_the_xla_loss_on_the_cpu():
    b, t, v, d = 2, 512, 32768, 256
    args = _loss_inputs(b, t, v, d)
    tpu_value, tpu_grads = _kernel_loss_grad()(*args)
    cpu_value, cpu_grads = _loss_grad(b, t, v, d, 256)(*jax.device_put(args, jax.devices("cpu")[0]))
    np.testing.assert_allclose(float(tpu_value), float(cpu_value), rtol=1e-2)
    for got, want in zip(tpu_grads, cpu_grads):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_the_logit_kernels_temporaries_do_not_grow_with_rows_times_vocabulary():
    """The 270M pair's head (262,144 x 640): the kernels' temporaries for the loss's value and gradient at 16k
    tokens stay under 1.5 GB, and four times the tokens add under 0.2 GB."""
    temps = {}
    for batch in (8, 32):
        shapes = [((batch, 2048, 640), jnp.bfloat16), ((262144, 640), jnp.float32),
                  ((batch, 2048, 640), jnp.bfloat16), ((262144, 640), jnp.bfloat16), ((batch, 2048), jnp.int32),
                  ((batch, 2048), jnp.float32)]
        arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
        compiled = _kernel_loss_grad().lower(*arguments).compile()
        temps[batch] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[8] <= 1.5e9 and temps[32] - temps[8] <= 0.2e9, temps


def _attention_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma3_text", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"]))


def test_splash_attention_on_the_chip_matches_the_xla_path():
    model = create_model(_attention_config(), seed=3)
    rng = np.random.default_rng(1)
    segments = jnp.asarray(np.repeat(np.array([[1, 2, 3, 3]]), 256, axis=1), jnp.int32)
    ids = jnp.asarray(rng.integers(0, 4096, segments.shape), jnp.int32)
    graph, state = nnx.split(model)

    def loss(state, kernel):
        out = nnx.merge(graph, state)(ids, positions=segment_positions(segments), segment_ids=segments,
                                      attention_kernel=kernel)
        return jnp.mean(jax.nn.logsumexp(out.logits.astype(jnp.float32), -1)), out.logits

    (_, logits_x), grads_x = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(state, "xla")
    (_, logits_s), grads_s = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(state, "splash")
    scale = float(jnp.max(jnp.abs(logits_x)))
    assert float(jnp.max(jnp.abs(logits_s - logits_x))) <= 2e-2 * scale
    for gx, gs in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_s)):
        assert float(jnp.max(jnp.abs(gs - gx))) <= 3e-2 * (float(jnp.max(jnp.abs(gx))) + 1e-6)


def test_the_compiled_step_is_what_the_chip_holds():
    """The 270M pair's train step at 4 x 2048 tokens: XLA's memory analysis of the executable the run compiled
    against the chip's `bytes_in_use + bytes_reserved` peak (which also holds the models' own copies): within 10%."""
    import tpu_bench

    models = tpu_bench.make_pair("270m")
    record = tpu_bench.measure({"pair": "270m", "batch": 4, "remat": None, "attention": "auto"}, models,
                               type("Args", (), {"warmup": 1, "steps": 2, "first": True})())
    assert "error" not in record, record.get("error")
    assert 0.9 <= record["peak_device_bytes"] / record["compiled_bytes"] <= 1.1, record
