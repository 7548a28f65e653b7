"""The family registry answers what differs by family: the divisibility rule the spec, the search and the config
check apply, and the GGUF metadata conversion (export then import gives the config back), or why a family has
none."""
from __future__ import annotations

import math

import gguf
import pytest

from nnx_surgery.surgery import CheckpointError, ConfigError, ModelConfig, SpecError, StudentSpec
from nnx_surgery.surgery.families import BY_GGUF_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, GEMMA, \
    HIDDEN_MULTIPLE_OF_HEADS, LLAMA
from nnx_surgery.surgery.storage.gguf_import import GGUFFile, hf_config_dict
from nnx_surgery.export.gguf_export import add_model_metadata, check_exportable

SIZES = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8)
# What a GGUF file does not state, as transformers' config classes assume it (see families/gemma.py).
GEMMA_GGUF = {
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=256, sliding_window=5, attn_logit_softcapping=40.0,
                   final_logit_softcapping=20.0, layer_types=["sliding_attention", "full_attention"] * 3),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=5, tie_word_embeddings=False, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"]),
}


def config(model_type: str, **changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({"model_type": model_type, **SIZES, **changes})


def test_every_model_type_has_one_family_and_every_family_a_gguf_answer():
    for family in FAMILIES:
        assert all(BY_MODEL_TYPE[t] is family for t in family.architectures)
        assert (family.gguf is None) != (not family.no_gguf), family.name
        assert family.hidden_multiple_of_heads <= set(family.architectures), family.name
    assert {t for _, t in BY_GGUF_ARCHITECTURE.values()} == set(GEMMA.architectures)


@pytest.mark.parametrize("model_type", list(BY_MODEL_TYPE))
def test_the_divisibility_rule_per_family(model_type):
    """The family names its rule; the config and the spec refuse what it forbids, naming family and rule."""
    family = BY_MODEL_TYPE[model_type]
    forbids = model_type in family.hidden_multiple_of_heads
    assert family.broken_rule(model_type, 48, 8) is None
    assert family.broken_rule(model_type, 44, 8) == (HIDDEN_MULTIPLE_OF_HEADS if forbids else None)
    extra = GEMMA_GGUF.get(model_type, {})
    teacher = config(model_type, **{k: v for k, v in extra.items() if k != "tie_word_embeddings"})
    spec = StudentSpec(4, 44, 64, 8, 4)
    if not forbids:
        assert spec.check_against(teacher) == "select"
        assert config(model_type, hidden_size=44).hidden_size == 44
        return
    expected = f"the {family.name} family's rule for {model_type} \\({HIDDEN_MULTIPLE_OF_HEADS}"
    with pytest.raises(SpecError, match=expected + ".*Use hidden_size=40 or 48"):
        spec.check_against(teacher)
    with pytest.raises(ConfigError, match=f"the {family.name} family's rule: {HIDDEN_MULTIPLE_OF_HEADS}"):
        config(model_type, hidden_size=44)


def test_the_rules_are_the_ones_named():
    assert GEMMA.hidden_multiple_of_heads == {"gemma2", "gemma3_text"}
    assert LLAMA.hidden_multiple_of_heads == {"llama"}


def metadata_of(config: ModelConfig, path) -> dict:
    """The GGUF metadata an export writes for `config` (no tensors), read back by the importer's parser."""
    arch = check_exportable(config, str(path.parent))
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        add_model_metadata(writer, config, "round-trip", gguf.LlamaFileType.ALL_F32)
        writer.add_vocab_size(config.vocab_size)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()
    return GGUFFile(str(path)).metadata


@pytest.mark.parametrize("model_type", list(GEMMA_GGUF))
def test_a_gemma_config_round_trips_through_its_gguf_metadata(model_type, tmp_path):
    original = config(model_type, **GEMMA_GGUF[model_type])
    metadata = metadata_of(original, tmp_path / "model.gguf")
    assert metadata["general.architecture"] == {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}[
        model_type]
    tensors = set() if original.tie_word_embeddings else {"output.weight"}
    again = ModelConfig.from_hf_dict(hf_config_dict(metadata, tensors, "round-trip.gguf"))
    assert math.isclose(again.rms_norm_eps, original.rms_norm_eps, rel_tol=1e-6)  # stored as float32
    assert again.replace(rms_norm_eps=original.rms_norm_eps) == original
    # llama.cpp's fixed 1/sqrt(head_dim) against the config's 1/sqrt(query_pre_attn_scalar)
    assert math.isclose(GEMMA.gguf.query_scale(original), 1.0 if model_type == "gemma" else math.sqrt(8 / 256))


@pytest.mark.parametrize("model_type", list(LLAMA.architectures))
def test_a_llama_config_has_no_gguf_conversion_and_says_why(model_type, tmp_path):
    teacher = config(model_type)
    assert teacher.family.gguf is None
    why = "the llama family .*no GGUF conversion.*q/k rows"
    with pytest.raises(CheckpointError, match=f"model_type '{model_type}'.*{why}"):
        check_exportable(teacher, str(tmp_path))
    metadata = {"general.architecture": "llama", "llama.attention.head_count": 8}
    with pytest.raises(CheckpointError, match=f"architecture 'llama' is not supported.*{why}"):
        hf_config_dict(metadata, set(), "llama.gguf")
