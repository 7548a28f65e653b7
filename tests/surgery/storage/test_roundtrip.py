"""`save_pretrained` -> transformers: clean loading info, same logits, sharded index, config.json keys that both
transformers 5 and 4.5x read the same way, tokenizer/generation config copied, bf16, atomic writes."""
from __future__ import annotations

import hashlib
import json
import os
import stat

import numpy as np
import pytest
import torch
import jax.numpy as jnp
from safetensors import safe_open

import nnx_surgery.surgery.storage.hf_checkpoint as checkpoint_module
from hf_reference import (assert_clean_loading, hf_forward, load_with_info, make_hf_model, make_hf_multimodal,
                          max_abs_diff, sample_ids, save_tiny_tokenizer)
from nnx_surgery.surgery import CheckpointError, load_pretrained, save_pretrained
from nnx_surgery.surgery.storage.hf_checkpoint import write_hf_folder
from nnx_surgery.surgery.storage.safetensors_stream import INDEX_FILE, PendingTensor

TOL = 1e-4
IDS = sample_ids(2, 13)
FAMILY_CASES = {"gemma": ("gemma", {}), "gemma2_untied": ("gemma2", dict(tie_word_embeddings=False)),
                "gemma3": ("gemma3_text", {})}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """name -> (folder with tokenizer + generation config, loaded NNX model, teacher logits)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            family, overrides = FAMILY_CASES[name]
            hf_model = make_hf_model(family, seed=11, **overrides)
            folder = str(tmp_path_factory.mktemp(f"teacher_{name}"))
            hf_model.save_pretrained(folder)  # writes generation_config.json too
            save_tiny_tokenizer(folder)
            cache[name] = (folder, load_pretrained(folder), hf_forward(hf_model, IDS)["logits"])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def sharded_save(teacher, tmp_path_factory):
    folder, model, _ = teacher("gemma3")
    out = str(tmp_path_factory.mktemp("saved") / "student")
    save_pretrained(model, out, source=folder, max_shard_size="20KB")
    return out


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_transformers_reloads_saved_model(teacher, tmp_path, name):
    folder, model, teacher_logits = teacher(name)
    out = save_pretrained(model, tmp_path / "out", source=folder)
    hf_model, info = load_with_info(out)
    assert_clean_loading(info)
    ours = np.asarray(model(jnp.asarray(IDS)).logits)
    reloaded = hf_forward(hf_model, IDS)["logits"]
    assert max_abs_diff(reloaded, ours) <= TOL and max_abs_diff(reloaded, teacher_logits) <= TOL
    expected_lm_head = not model.config.tie_word_embeddings
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        assert ("lm_head.weight" in f.keys()) == expected_lm_head


def test_sharded_save_reloads_with_index(sharded_save, teacher):
    _, model, teacher_logits = teacher("gemma3")
    with open(os.path.join(sharded_save, INDEX_FILE)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not os.path.exists(os.path.join(sharded_save, "model.safetensors"))
    stored = 0
    for name in files:
        with safe_open(os.path.join(sharded_save, name), "np") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                stored += f.get_tensor(key).nbytes
    assert index["metadata"]["total_size"] == stored
    hf_model, info = load_with_info(sharded_save)
    assert_clean_loading(info)
    assert max_abs_diff(hf_forward(hf_model, IDS)["logits"], teacher_logits) <= TOL
    assert max_abs_diff(np.asarray(load_pretrained(sharded_save)(jnp.asarray(IDS)).logits), teacher_logits) <= TOL


def test_config_json_has_both_rope_formats_and_explicit_fields(sharded_save):
    with open(os.path.join(sharded_save, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1e6}
    assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    # legacy keys, for transformers 4.5x (which silently drops rope_parameters)
    assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 1e4
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["sliding_window_pattern"] == 3
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention"]
    assert config["query_pre_attn_scalar"] == 20 and config["head_dim"] == 12 and config["sliding_window"] == 5
    assert config["dtype"] == "float32"


def test_tokenizer_and_generation_config_copied(sharded_save, teacher):
    folder, _, _ = teacher("gemma3")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert _digest(os.path.join(sharded_save, name)) == _digest(os.path.join(folder, name)), name
    from transformers import AutoTokenizer

    text = "t5 t17 t95 nothing"
    assert AutoTokenizer.from_pretrained(sharded_save)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_saved_folder_is_readable_by_others(sharded_save):
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(sharded_save).st_mode) == 0o777 & ~umask


def test_bf16_save_loads_as_bf16(teacher, tmp_path):
    folder, model, _ = teacher("gemma2_untied")
    out = save_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    import transformers

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert_clean_loading(info)
    assert {p.dtype for p in hf_model.parameters()} == {torch.bfloat16}
    again = load_pretrained(out)
    assert again.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(again.norm.scale[...]),
                                  np.asarray(model.norm.scale[...].astype(jnp.bfloat16)))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    upcast = load_pretrained(out, dtype="float32")
    assert max_abs_diff(upcast(jnp.asarray(IDS)).logits, hf_forward(ref, IDS)["logits"]) <= TOL


def test_multimodal_teacher_saves_as_text_only(tmp_path):
    hf_model = make_hf_multimodal(seed=5)
    hf_model.save_pretrained(tmp_path / "mm")
    model = load_pretrained(tmp_path / "mm")
    out = save_pretrained(model, tmp_path / "text", source=tmp_path / "mm")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "gemma3_text" and "vision_config" not in config
    reloaded, info = load_with_info(out)
    assert_clean_loading(info)
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert max_abs_diff(hf_forward(reloaded, IDS)["logits"], hf_forward(hf_model, IDS)["logits"]) <= TOL


# ------------------------------------------------------------------------------------------------ atomic writes
def _tensors(fail_at: int | None = None) -> list[PendingTensor]:
    def produce(i):
        if i == fail_at:
            raise RuntimeError("device lost while gathering")
        return np.full((4, 3), i, np.float32)

    return [PendingTensor(f"t{i}", (4, 3), np.dtype(np.float32), lambda i=i: produce(i)) for i in range(5)]


def _snapshot(folder: str) -> dict[str, str]:
    return {name: _digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def test_failed_write_leaves_nothing(teacher, tmp_path):
    _, model, _ = teacher("gemma")
    out = tmp_path / "new"
    with pytest.raises(RuntimeError, match="device lost"):
        write_hf_folder(str(out), model.config, _tensors(fail_at=3), max_shard_size="100B")
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_existing_folder(teacher, tmp_path):
    folder, model, _ = teacher("gemma")
    out = save_pretrained(model, tmp_path / "out", source=folder)
    before = _snapshot(out)
    with pytest.raises(RuntimeError, match="device lost"):
        write_hf_folder(out, model.config, _tensors(fail_at=4), overwrite=True)
    assert _snapshot(out) == before and os.listdir(tmp_path) == ["out"]


def test_failure_inside_save_pretrained_keeps_existing_folder(teacher, tmp_path, monkeypatch):
    folder, model, _ = teacher("gemma")
    out = save_pretrained(model, tmp_path / "out")
    before = _snapshot(out)

    def broken_copy(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "copy_aux_files", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, out, source=folder, overwrite=True)
    assert _snapshot(out) == before and os.listdir(tmp_path) == ["out"]


def test_overwrite_replaces_whole_folder(teacher, tmp_path):
    folder, model, _ = teacher("gemma")
    out = save_pretrained(model, tmp_path / "out", max_shard_size="20KB")
    assert os.path.exists(os.path.join(out, INDEX_FILE))
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match="overwrite=True"):  # not replaced unless asked
        save_pretrained(model, out)
    assert _snapshot(out) == before
    save_pretrained(model, out, overwrite=True)  # now one file: the stale shards and index must be gone
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]
    with pytest.raises(CheckpointError, match="not a folder"):
        save_pretrained(model, os.path.join(out, "config.json"))


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_config_survives_its_own_json_and_the_legacy_keys_alone(teacher, name):
    """What we write reads back equal; so does the same dict with only the legacy (transformers 4) rope keys."""
    from nnx_surgery.surgery import ModelConfig

    config = teacher(name)[1].config
    written = config.to_hf_dict(dtype="float32")
    assert ModelConfig.from_hf_dict(written) == config
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    assert ModelConfig.from_hf_dict(legacy) == config
