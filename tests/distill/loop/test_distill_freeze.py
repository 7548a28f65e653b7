"""Freeze masks: path patterns with brace ranges and globs, NNX filters, the split, optimizer-state carry-over."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_surgery.distill.loop.freeze import (carry_matching, expand_braces, pattern_matches, selected_paths,
                                             split_trainable, trainable_filter)
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model


@pytest.fixture(scope="module")
def model():
    config = ModelConfig.from_hf_dict(dict(model_type="gemma", vocab_size=32, hidden_size=8, intermediate_size=12,
                                           num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=4))
    return create_model(config)


def test_brace_expansion():
    assert expand_braces("layers.{0-2}.mlp") == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
    assert expand_braces("{a,b}.{1-2}") == ["a.1", "a.2", "b.1", "b.2"]
    assert expand_braces("embed_tokens") == ["embed_tokens"]
    with pytest.raises(ValueError, match="backwards"):
        expand_braces("layers.{5-2}")


@pytest.mark.parametrize("pattern,path,expected", [
    ("layers.{0-9}.*", "layers.3.self_attn.k_proj.weight", True),
    ("layers.{0-9}.*", "layers.10.self_attn.k_proj.weight", False),
    ("layers.1", "layers.1.mlp.up_proj.weight", True),  # a prefix of whole segments
    ("layers.1", "layers.11.mlp.up_proj.weight", False),
    ("*.mlp.*", "layers.7.mlp.down_proj.weight", True),
    ("*.mlp.*", "layers.7.self_attn.o_proj.weight", False),
    ("embed_tokens", "embed_tokens", True),
    ("*norm*", "layers.0.post_attention_layernorm.scale", True),
    ("layers.*.self_attn.{q,k}_proj", "layers.4.self_attn.k_proj.weight", True),
    ("layers.*.self_attn.{q,k}_proj", "layers.4.self_attn.v_proj.weight", False),
])
def test_pattern_matching(pattern, path, expected):
    assert pattern_matches(pattern, path) == expected


def test_split_by_patterns_and_by_nnx_filter_agree(model):
    by_pattern = selected_paths(model, trainable=["*.mlp.*"], frozen=["layers.{0-5}"])
    assert by_pattern == [f"layers.{i}.mlp.{name}.weight" for i in range(6, 12)
                          for name in ("down_proj", "gate_proj", "up_proj")]
    by_filter = selected_paths(model, trainable=nnx.PathContains("mlp"),
                               frozen=lambda path, value: path[0] == "layers" and path[1] < 6)
    assert by_filter == by_pattern
    _, trainable, rest = split_trainable(model, trainable=["*.mlp.*"])
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert sum(x.size for x in jax.tree.leaves(trainable)) + sum(x.size for x in jax.tree.leaves(rest)) == total
    assert trainable_filter()(("embed_tokens",), model.embed_tokens)  # None trains every parameter


def test_bad_patterns_fail_with_a_suggestion(model):
    with pytest.raises(ValueError, match="did you mean.*embed_tokens"):
        split_trainable(model, frozen=["embed"])
    with pytest.raises(ValueError, match="no trainable parameter left"):
        split_trainable(model, trainable=["layers.3"], frozen=["layers.{0-11}"])


def test_stage_switch_carries_adam_moments_of_parameters_that_stay_trainable(model):
    adam = optax.scale_by_adam()
    _, first, _ = split_trainable(model, trainable=["layers.{0-1}.mlp"])
    old = adam.init({"student": first})
    old = jax.tree.map(lambda x: x + jnp.asarray(7, x.dtype), old)  # recognisable moments and step count
    _, second, _ = split_trainable(model, trainable=["layers.{1-2}.mlp"])
    new, carried = carry_matching(adam.init({"student": second}), old)
    assert carried == 1 + 2 * 3  # the step counter and mu / nu of layer 1's three MLP weights
    assert int(new.count) == 7
    np.testing.assert_array_equal(new.mu["student"]["layers"][1]["mlp"]["up_proj"]["weight"][...], 7.0)
    np.testing.assert_array_equal(new.nu["student"]["layers"][2]["mlp"]["up_proj"]["weight"][...], 0.0)
    assert jnp.shape(new.mu["student"]["layers"][2]["mlp"]["down_proj"]["weight"][...]) == (8, 12)
