"""Broken checkpoints and configs give a CheckpointError / ConfigError that names the file or tensor, never a deep
traceback and never a model with silently random weights."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_reference import make_hf_model, max_abs_diff, sample_ids
from surgery import CheckpointError, ConfigError, GemmaConfig, load_pretrained
from surgery.checkpoint import _check_tied_head, canonical_names
from surgery.safetensors_io import INDEX_FILE, checkpoint_weight_map

NORM = "model.layers.1.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid gemma2 checkpoint, single file and sharded; tests copy it before breaking it."""
    root = tmp_path_factory.mktemp("good")
    model = make_hf_model("gemma2", seed=3, num_hidden_layers=2, layer_types=None)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


@pytest.fixture
def ckpt(good, tmp_path):
    def copy(kind: str = "single") -> str:
        target = tmp_path / kind
        shutil.copytree(good / kind, target)
        return str(target)

    return copy


def _rewrite(folder: str, change) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    for key, value in changes.items():
        if value is _DELETE:
            del config[key]
    with open(path, "w") as f:
        json.dump(config, f)


_DELETE = object()


def _raises(error, folder: str, *fragments: str):
    with pytest.raises(error) as info:
        load_pretrained(folder)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert info.value.__cause__ is None  # no chained low-level exception behind it
    return message


def test_good_checkpoint_loads(good):
    assert load_pretrained(good / "single").config.num_hidden_layers == 2


def test_truncated_file(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    _raises(CheckpointError, folder, path, "truncated")


def test_file_shorter_than_its_header(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, 5)
    _raises(CheckpointError, folder, path, "truncated")


def test_corrupt_header(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00{{not json")
    _raises(CheckpointError, folder, path, "corrupt")


def test_missing_tensor(ckpt):
    folder = ckpt()
    _rewrite(folder, lambda t: t.pop(NORM))
    _raises(CheckpointError, folder, NORM, "lacks")


def test_wrong_shape(ckpt):
    folder = ckpt()
    name = "model.layers.0.self_attn.k_proj.weight"

    def change(tensors):
        tensors[name] = np.zeros((12, 32), np.float32)  # one KV head instead of two

    _rewrite(folder, change)
    _raises(CheckpointError, folder, name, "[12, 32]", "[24, 32]")


def test_unexpected_extra_tensor(ckpt):
    folder = ckpt()
    extra = "model.layers.2.input_layernorm.weight"  # a third layer the config does not have

    def change(tensors):
        tensors[extra] = np.zeros(32, np.float32)

    _rewrite(folder, change)
    _raises(CheckpointError, folder, extra, "does not use")


def test_unsupported_tensor_dtype(ckpt):
    folder = ckpt()

    def change(tensors):
        tensors[NORM] = tensors[NORM].astype(np.int32)

    _rewrite(folder, change)
    _raises(CheckpointError, folder, NORM, "I32")


def test_untied_config_without_lm_head(ckpt):
    """transformers would load this with a random lm_head (missing_keys); we refuse."""
    folder = ckpt()
    _edit_config(folder, tie_word_embeddings=False)
    _raises(CheckpointError, folder, "lm_head.weight", "lacks")


def test_tied_config_with_equal_lm_head_loads(ckpt):
    folder = ckpt()
    reference = load_pretrained(folder)

    def change(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    _rewrite(folder, change)
    ids = sample_ids(1, 7)
    assert max_abs_diff(load_pretrained(folder)(ids).logits, reference(ids).logits) == 0.0


def test_tied_config_with_different_lm_head(ckpt):
    """Only the last vocabulary row differs; the block-wise comparison must still see it."""
    folder = ckpt()

    def change(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["lm_head.weight"][-1, 0] += 1.0

    _rewrite(folder, change)
    _raises(CheckpointError, folder, "lm_head.weight", "tie_word_embeddings")
    weight_map = checkpoint_weight_map(folder)
    names, _ = canonical_names(weight_map)
    with pytest.raises(CheckpointError, match="differs from the embedding"):
        _check_tied_head(folder, weight_map, names, rows_per_read=10)


def test_unknown_model_type(ckpt):
    folder = ckpt()
    _edit_config(folder, model_type="llama")
    _raises(ConfigError, folder, "config.json", "'llama'")


def test_heads_not_multiple_of_kv_heads(ckpt):
    folder = ckpt()
    _edit_config(folder, num_attention_heads=4, num_key_value_heads=3)
    _raises(ConfigError, folder, "num_attention_heads=4", "num_key_value_heads=3")


def test_layer_types_length_mismatch(ckpt):
    folder = ckpt()
    _edit_config(folder, layer_types=["sliding_attention"] * 3)
    _raises(ConfigError, folder, "layer_types", "num_hidden_layers is 2")


def test_unsupported_activation_and_rope(ckpt):
    folder = ckpt()
    _edit_config(folder, hidden_activation="gelu")  # exact GELU: transformers would use it for Gemma 2
    _raises(ConfigError, folder, "hidden_activation", "'gelu'")
    _edit_config(folder, hidden_activation="gelu_pytorch_tanh",
                 rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    _raises(ConfigError, folder, "'yarn'")


def test_missing_and_invalid_config(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        f.write("{not json")
    _raises(ConfigError, folder, path, "not valid JSON")
    os.remove(path)
    _raises(ConfigError, folder, path, "not found")


def test_index_points_at_missing_file(ckpt):
    folder = ckpt("sharded")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    os.remove(os.path.join(folder, files[1]))
    _raises(CheckpointError, folder, INDEX_FILE, files[1])


def test_index_claims_a_tensor_its_file_lacks(ckpt):
    folder = ckpt("sharded")
    index_path = os.path.join(folder, INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    embed_file = index["weight_map"]["model.embed_tokens.weight"]
    other = next(v for v in index["weight_map"].values() if v != embed_file)
    index["weight_map"]["model.embed_tokens.weight"] = other
    with open(index_path, "w") as f:
        json.dump(index, f)
    _raises(CheckpointError, folder, other, "model.embed_tokens.weight")


def test_invalid_index(ckpt):
    folder = ckpt("sharded")
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}}, f)
    _raises(CheckpointError, folder, INDEX_FILE, "weight_map")


def test_folder_without_weights(ckpt):
    folder = ckpt()
    os.remove(os.path.join(folder, "model.safetensors"))
    _raises(CheckpointError, folder, "model.safetensors")


def test_source_that_is_neither_folder_nor_repo_id(tmp_path):
    """A missing local path (not a valid repo id) must not turn into a Hub request."""
    with pytest.raises(CheckpointError, match="neither a local folder nor a valid Hub repo id"):
        load_pretrained(str(tmp_path / "does" / "not" / "exist"))
    file_path = tmp_path / "model.safetensors"
    file_path.write_bytes(b"12345678")
    with pytest.raises(CheckpointError, match="is a file"):
        load_pretrained(file_path)


def test_config_defaults_match_transformers_for_sparse_multimodal_config():
    """The gemma-3-4b config on the Hub lists only what differs from the class defaults."""
    import transformers

    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model"}}
    ours = GemmaConfig.from_hf_dict(sparse)
    theirs = transformers.Gemma3Config(**sparse).text_config
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "query_pre_attn_scalar", "sliding_window", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert list(ours.layer_types) == theirs.layer_types
    rope = theirs.rope_parameters
    assert ours.rope["full_attention"].theta == rope["full_attention"]["rope_theta"] == 1e6
    assert ours.rope["full_attention"].linear_factor == rope["full_attention"]["factor"] == 8.0
    assert ours.rope["sliding_attention"].theta == rope["sliding_attention"]["rope_theta"]
    gemma2 = GemmaConfig.from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 2})
    reference = transformers.Gemma2Config(num_hidden_layers=2)
    assert (gemma2.final_logit_softcapping, gemma2.attn_logit_softcapping, gemma2.query_pre_attn_scalar) == \
        (reference.final_logit_softcapping, reference.attn_logit_softcapping, reference.query_pre_attn_scalar)
