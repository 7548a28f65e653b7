"""NNX Gemma loaded by `load_pretrained` against transformers on tiny checkpoints of all three families.

The tiny configs are odd on purpose (tests/hf_reference.py): head_dim 12 != hidden/heads 8, GQA (4 heads, 2 KV)
and MQA (1 KV), query_pre_attn_scalar 20 != head_dim, sliding window 5 < sequence 13, Gemma 2 soft-caps,
Gemma 3 linear RoPE x4 on full layers only, random norm weights. `test_quirks_are_exercised` shows each quirk
moves the logits far beyond the 1e-4 tolerance, so the parity tests would catch it being dropped.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
import jax
import jax.numpy as jnp
from flax import nnx

from hf_reference import (FAMILIES, hf_forward, hf_logits, make_hf_model, make_hf_multimodal, max_abs_diff,
                          sample_ids)
from nnx_surgery.surgery import CausalLM, load_pretrained
from nnx_surgery.surgery.modeling.model_config import FULL, Rope, SLIDING

TOL = 1e-4
IDS = sample_ids(2, 13)  # 13 > sliding window 5

# name -> (family, config overrides, save kwargs)
CASES = {
    "gemma": ("gemma", {}, {}),
    "gemma_mqa_untied": ("gemma", dict(num_key_value_heads=1, tie_word_embeddings=False), {}),
    "gemma2": ("gemma2", {}, {}),
    "gemma2_mqa_untied": ("gemma2", dict(num_key_value_heads=1, tie_word_embeddings=False), {}),
    "gemma3": ("gemma3_text", {}, {}),
    "gemma3_mqa_sharded": ("gemma3_text", dict(num_key_value_heads=1), dict(max_shard_size="20KB")),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (transformers model, folder); built once per module, on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            family, overrides, save_kwargs = CASES[name]
            model = make_hf_model(family, seed=len(cache), **overrides)
            folder = str(tmp_path_factory.mktemp(name))
            model.save_pretrained(folder, **save_kwargs)
            cache[name] = (model, folder)
        return cache[name]

    return get


def logits(model: CausalLM, ids=IDS, **kwargs) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids), **kwargs).logits)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoint, name):
    hf_model, folder = checkpoint(name)
    model = load_pretrained(folder)
    assert model.dtype == jnp.float32
    ours, ref = logits(model), hf_logits(hf_model, IDS)
    assert np.abs(ref).max() > 1.0  # random norms: logits far from zero, so (1 + w) and scales matter
    assert max_abs_diff(ours, ref) <= TOL


def test_sharded_checkpoint_really_has_several_files(checkpoint):
    import json
    import os

    _, folder = checkpoint("gemma3_mqa_sharded")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 2 and not os.path.exists(os.path.join(folder, "model.safetensors"))


def _with_config(model: CausalLM, **changes) -> CausalLM:
    """The same weights under a changed config (to switch one quirk off)."""
    other = nnx.eval_shape(lambda: CausalLM(model.config.replace(**changes)))
    nnx.update(other, nnx.state(model))
    return other


@pytest.mark.parametrize("name, changes", [
    ("gemma2", dict(query_pre_attn_scalar=12)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(layer_types=(FULL,) * 4)),
    ("gemma3", dict(query_pre_attn_scalar=12)),
    ("gemma3", dict(layer_types=(FULL,) * 4)),
    ("gemma3", dict(rope={FULL: Rope(1e6), SLIDING: Rope(1e4)})),
    ("gemma3", dict(rope={FULL: Rope(1e6, "linear", 4.0), SLIDING: Rope(1e6, "linear", 4.0)})),
], ids=["gemma2-qpas", "gemma2-attn-softcap", "gemma2-final-softcap", "gemma2-window",
        "gemma3-qpas", "gemma3-window", "gemma3-linear-rope", "gemma3-local-theta"])
def test_quirks_are_exercised(checkpoint, name, changes):
    """Each config-driven quirk changes these logits by far more than the parity tolerance."""
    _, folder = checkpoint(name)
    model = load_pretrained(folder)
    assert max_abs_diff(logits(_with_config(model, **changes)), logits(model)) > 100 * TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_via_attention_mask(checkpoint, family):
    name = {"gemma3_text": "gemma3"}.get(family, family)
    hf_model, folder = checkpoint(name)
    mask = np.ones_like(IDS)
    mask[0, :4] = 0  # left padding in row 0
    ids = np.where(mask == 1, IDS, 0)
    ours = logits(load_pretrained(folder), ids, attention_mask=jnp.asarray(mask))
    ref = hf_forward(hf_model, ids, mask)["logits"]
    valid = mask.astype(bool)
    assert max_abs_diff(ours[valid], ref[valid]) <= TOL
    unpadded = logits(load_pretrained(folder), ids)
    assert max_abs_diff(unpadded[valid], ref[valid]) > 100 * TOL  # the mask does change something


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_intermediates_inside_jit(checkpoint, family):
    name = {"gemma3_text": "gemma3"}.get(family, family)
    hf_model, folder = checkpoint(name)
    model = load_pretrained(folder)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids, capture=("residual", "attention_probs"))

    out = forward(state, jnp.asarray(IDS))
    original = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")  # sdpa returns no attention probabilities
    try:
        ref = hf_forward(hf_model, IDS, hidden_states=True, attentions=True)
    finally:
        hf_model.set_attn_implementation(original)
    num_layers = model.config.num_hidden_layers
    assert len(out.residual) == num_layers + 1 == len(ref["hidden_states"])
    for i in range(num_layers):  # HF's last entry is after the final norm: compare it with final_hidden
        assert max_abs_diff(out.residual[i], ref["hidden_states"][i]) <= TOL
    assert max_abs_diff(out.final_hidden, ref["hidden_states"][num_layers]) <= TOL
    assert max_abs_diff(out.residual[num_layers], ref["hidden_states"][num_layers]) > 100 * TOL
    assert len(out.attention_probs) == num_layers
    for i in range(num_layers):
        assert out.attention_probs[i].shape == ref["attentions"][i].shape == (2, 4, 13, 13)
        assert max_abs_diff(out.attention_probs[i], ref["attentions"][i]) <= 1e-5
    if family != "gemma":  # sliding layer 0: nothing beyond the window of 5
        assert float(jnp.max(out.attention_probs[0][:, :, 12, :8])) == 0.0
    plain = model(jnp.asarray(IDS))
    assert plain.residual is plain.attention_probs is plain.head_outputs is None
    assert plain.mlp_activations is plain.normed_inputs is None


@pytest.fixture(scope="module")
def low_precision(tmp_path_factory):
    """family/dtype -> folder of a checkpoint saved by transformers in bf16 / f16."""
    cache = {}

    def get(family: str, torch_dtype):
        key = (family, torch_dtype)
        if key not in cache:
            folder = str(tmp_path_factory.mktemp(f"{family}_{str(torch_dtype)[6:]}"))
            make_hf_model(family, seed=7).to(torch_dtype).save_pretrained(folder)
            cache[key] = folder
        return cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_checkpoint_loaded_as_float32(low_precision, family, torch_dtype):
    """Reference: transformers loading the same folder in float32 (not a model cast back and forth, whose
    RoPE buffers would have been rounded)."""
    folder = low_precision(family, torch_dtype)
    model = load_pretrained(folder, dtype="float32")
    assert model.dtype == jnp.float32
    assert max_abs_diff(logits(model), hf_logits(folder, IDS, dtype=torch.float32)) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_native(low_precision, family, torch_dtype):
    """Native bf16/f16 against transformers in the same dtype: within a few times the dtype's own error (HF
    low precision vs HF float32), and the same next-token argmax (near-ties allowed to flip: >= 90%)."""
    folder = low_precision(family, torch_dtype)
    model = load_pretrained(folder)
    assert model.dtype == {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[torch_dtype]
    out = model(jnp.asarray(IDS), capture=("residual",))
    ours = np.asarray(out.logits)
    hf_low = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    ref = hf_forward(hf_low, IDS, hidden_states=True)
    ref_low, ref32 = ref["logits"], hf_logits(folder, IDS, dtype=torch.float32)
    assert max_abs_diff(ours, ref_low) <= 3 * max_abs_diff(ref_low, ref32) + 1e-3
    assert np.mean(ours.argmax(-1) == ref_low.argmax(-1)) >= 0.9
    # embeddings bit-exact: the sqrt(hidden) scale is rounded to the weight dtype first, as transformers does
    np.testing.assert_array_equal(np.asarray(out.residual[0], np.float32), ref["hidden_states"][0])


@pytest.mark.parametrize("dtype, expected", [
    ("bfloat16", jnp.bfloat16), ("bf16", jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16),
    (torch.bfloat16, jnp.bfloat16), (np.dtype("float32"), jnp.float32), ("float16", jnp.float16),
    ("auto", jnp.float32), (None, jnp.float32),
])
def test_dtype_argument(checkpoint, dtype, expected):
    _, folder = checkpoint("gemma")
    model = load_pretrained(folder, dtype=dtype)
    kernels = [v for v in jax.tree.leaves(nnx.state(model))]
    assert {k.dtype for k in kernels} == {jnp.dtype(expected)}


def test_dtype_argument_rejects_unknown(checkpoint):
    _, folder = checkpoint("gemma")
    for bad in ("float64", "int8", "fp8"):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            load_pretrained(folder, dtype=bad)


def test_multimodal_gemma3_loads_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (4B+ layout): `language_model.model.*` names, a vision tower and
    projector to ignore, a "gemma3" config whose text_config describes the model."""
    hf_model = make_hf_multimodal(seed=3)
    hf_model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)
    model = load_pretrained(tmp_path)
    assert model.config.model_type == "gemma3_text" and model.config.num_hidden_layers == 4
    assert model.config.rope[FULL].linear_factor == 4.0
    assert max_abs_diff(logits(model), hf_forward(hf_model, IDS)["logits"]) <= TOL
