"""GGUF import (surgery.storage.gguf_import) against transformers' own GGUF loading.

Tiny Gemma 1/2/3 GGUF files are written here the way llama.cpp's convert_hf_to_gguf.py writes a transformers model
(its metadata keys, tensor names from gguf's TensorNameMap, RMSNorm weights stored as 1 + w, no tied head, 1-D
tensors kept F32, a SentencePiece vocabulary with byte, control and user-defined tokens), in F32, F16 and Q8_0.
The reference is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`; transformers cannot read Gemma 1
GGUF files, so there it is the original model with the weights the file holds (quantised and dequantised by
gguf.quants, as llama.cpp does). The real Gemma 3 270M (Q4_K_M) is compared with transformers' float32
dequantisation of it (tests/real_gemma.py).
"""
from __future__ import annotations

import json
import os
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from hf_reference import make_hf_model, max_abs_diff, sample_ids
from nnx_surgery.surgery import CheckpointError, ModelConfig, load_pretrained
from nnx_surgery.surgery.storage.gguf_import import cached_import, import_gguf
from sample_texts import mixed_text

ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
# Q8_0 blocks are 32 values of a row: hidden, intermediate and heads * head_dim are multiples of 32.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# The values transformers assumes for what llama.cpp does not write (or what it drops), so that its GGUF model is
# the model the file was made from.
DEFAULTED = {"gemma": {}, "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0),
             "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window_pattern=6, num_hidden_layers=6,
                                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}})}
IDS = sample_ids(2, 13, vocab=300)  # 13 > sliding window 5
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"


def tiny_vocab() -> tuple[list[str], list[int]]:
    """A Gemma-like SentencePiece vocabulary: specials, a user-defined token, byte fallback, pieces with merges,
    runs of spaces stored as real spaces and runs of newlines (user-defined, as in Gemma's)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 3, 3, 4, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\n", "\n\n", "  ", "   ", "▁", "▁▁", "e", "t", "h", "a", "s", "i", "n", "o", "r", "d", "(", ")", ":",
              "th", "he", "▁t", "▁th", "the", "▁the", "in", "an", "▁a", "▁an", "▁and", "er", "es", "is", "▁is",
              "on", "or", "▁def", "de", "ef", "▁s", "st", "▁st", "ar", "art", "▁start", "re", "ed", "▁h"]
    tokens += pieces
    types += [4 if not t.strip() else 1 for t in pieces]
    return tokens, types


VOCAB, TOKEN_TYPES = tiny_vocab()


def tiny_model(family: str, seed: int = 0, **overrides):
    return make_hf_model(family, seed=seed, vocab_size=len(VOCAB), **{**SHAPE, **DEFAULTED[family], **overrides})


def write_gguf(model, path, qtype=Q.F32, *, arch: str | None = None, skip=(), retype=None) -> str:
    """`model` as llama.cpp's converter writes it (`skip`/`retype` tensors to make broken files)."""
    config = model.config
    family = config.model_type
    arch = arch or ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(FILE_TYPES[qtype])
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma3_text":
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB)
    writer.add_token_scores([-1000.0 if t == 3 else 0.0 if t == 6 else -float(i) for i, t in enumerate(TOKEN_TYPES)])
    writer.add_token_types(TOKEN_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if family == "gemma3_text":
        writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == ARCH[family]),
                                     config.num_hidden_layers)
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if gguf_name in skip:
            continue
        data = param.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's RMSNorm multiplies by the weight alone
        kind = Q.F32 if data.ndim <= 1 else qtype
        if retype and gguf_name in retype:
            writer.add_tensor(gguf_name, data.astype(retype[gguf_name]))
            continue
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """(family, qtype, config overrides) -> (original transformers model, GGUF path), written once per module."""
    cache = {}

    def get(family: str, qtype=Q.F32, **overrides):
        key = (family, qtype, tuple(sorted(overrides.items())))
        if key not in cache:
            model = tiny_model(family, seed=len(cache), **overrides)
            path = tmp_path_factory.mktemp(f"{family}-{qtype.name}") / "tiny.gguf"
            cache[key] = (model, write_gguf(model, path, qtype))
        return cache[key]

    return get


def transformers_gguf(path: str):
    directory, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def with_file_weights(model, qtype):
    """The original model holding what the file holds: matrices through gguf's quantise/dequantise, norms through
    the float32 `+ 1` and `- 1`."""
    state = {}
    for name, param in model.state_dict().items():
        data = param.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = (data + np.float32(1)) - np.float32(1)
        elif data.ndim == 2:
            data = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).reshape(data.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(data))
    copy = type(model)(model.config).eval()
    copy.load_state_dict(state)
    return copy


def torch_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long), use_cache=False).logits.float().numpy()


def ours_logits(folder: str, ids=IDS) -> np.ndarray:
    return np.asarray(load_pretrained(folder, dtype="float32")(jnp.asarray(ids)).logits)


TINY_CASES = [(family, qtype, {}) for family in ("gemma", "gemma2", "gemma3_text") for qtype in (Q.F32, Q.F16, Q.Q8_0)]
TINY_CASES += [("gemma3_text", Q.Q8_0, dict(tie_word_embeddings=False, num_key_value_heads=1))]  # output.weight, MQA


@pytest.mark.parametrize("family,qtype,overrides", TINY_CASES,
                         ids=[f"{f}-{q.name}{'-untied-mqa' if o else ''}" for f, q, o in TINY_CASES])
def test_tiny_import_matches_transformers(tiny_file, tmp_path, family, qtype, overrides):
    original, path = tiny_file(family, qtype, **overrides)
    folder = import_gguf(path, tmp_path / "hf", dtype="float32")
    config = ModelConfig.from_file(folder)
    assert config.model_type == family and config.tie_word_embeddings == original.config.tie_word_embeddings
    if family == "gemma":  # transformers reads no Gemma 1 GGUF
        with pytest.raises(Exception, match="gemma"):
            transformers_gguf(path)
        reference = with_file_weights(original, qtype)
    else:
        reference = transformers_gguf(path)
        assert ModelConfig.from_hf_dict(reference.config.to_dict()) == config
        from safetensors.numpy import load_file
        ours = load_file(os.path.join(folder, "model.safetensors"))
        theirs = {k: v for k, v in reference.state_dict().items() if k in ours}
        assert sorted(ours) == sorted(theirs)
        assert all(np.array_equal(ours[k], theirs[k].numpy()) for k in ours), "weights differ from transformers'"
    expected = torch_logits(reference)
    assert max_abs_diff(ours_logits(folder), expected) <= 1e-4
    if qtype == Q.F32:  # the file mirrors the original model
        assert max_abs_diff(torch_logits(original), expected) <= 1e-4


def test_tokenizer_matches_transformers(tiny_file, tmp_path):
    from tokenizers import Tokenizer
    from nnx_surgery.distill.inputs.batches import load_tokenizer

    _, path = tiny_file("gemma3_text")
    folder = import_gguf(path, tmp_path / "hf", dtype="float32")
    directory, name = os.path.split(path)
    theirs = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    texts = ["the start is the art", "  the   and\n\n\nis  st", "<start_of_turn>def start():<end_of_turn>",
             "é ü 漢字 ✓ \t tab", "[multimodal] <mask><bos> an hand", "   leading and trailing  "]
    ours = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    reloaded = transformers.AutoTokenizer.from_pretrained(folder)
    for text in texts:
        expected = theirs(text)["input_ids"]
        assert expected[0] == 2 and len(expected) > 3
        assert ours.encode(text).ids == expected, text
        assert reloaded(text)["input_ids"] == expected, text
    loaded = load_tokenizer(folder)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.add_bos) == (2, 1, 0, True)
    plain = theirs(texts[:2], add_special_tokens=False)["input_ids"]
    assert loaded.encode_batch(texts[:2]) == plain
    assert reloaded.chat_template == theirs.chat_template == CHAT_TEMPLATE
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (2, 1, 0)


def test_file_facts_transformers_drops(tmp_path):
    """Gemma 3 linear RoPE scaling and Gemma 2 soft-caps stated in the file are kept: the import is the model the
    file was made from (llama.cpp applies them; transformers 5.24 reads neither key)."""
    for family, overrides in (("gemma3_text", dict(rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
            ("gemma2", dict(attn_logit_softcapping=3.0, final_logit_softcapping=4.0))):
        original = tiny_model(family, **overrides)
        path = write_gguf(original, tmp_path / f"{family}.gguf")
        folder = import_gguf(path, tmp_path / family, dtype="float32")
        assert max_abs_diff(ours_logits(folder), torch_logits(original)) <= 1e-4


def test_cached_import(tiny_file, tmp_path, monkeypatch):
    monkeypatch.setenv("NNX_SURGERY_CACHE", str(tmp_path / "cache"))
    _, source = tiny_file("gemma2")
    path = shutil.copy(source, tmp_path / "model.gguf")
    first = cached_import(path, "bfloat16")
    assert first.startswith(str(tmp_path / "cache" / "gguf"))
    assert ModelConfig.from_file(first).model_type == "gemma2"
    with open(os.path.join(first, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert cached_import(path, "bfloat16") == first  # not imported again
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    assert cached_import(path, "float32") != first
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a changed file is imported again
    assert cached_import(path, "bfloat16") != first
    assert not [n for n in os.listdir(tmp_path / "cache" / "gguf") if n.startswith(".")]  # no partial folders


def broken_files(tiny_file, tmp_path) -> dict[str, tuple[str, str]]:
    """case -> (GGUF path, text the error must name)."""
    model, good = tiny_file("gemma2")
    truncated = tmp_path / "truncated.gguf"
    with open(good, "rb") as f:
        truncated.write_bytes(f.read()[: os.path.getsize(good) - 1000])
    llama = write_gguf(model, tmp_path / "llama.gguf", arch="llama")
    f64 = write_gguf(model, tmp_path / "f64.gguf", retype={"blk.1.attn_norm.weight": np.float64})
    missing = write_gguf(model, tmp_path / "missing.gguf", skip={"blk.1.ffn_down.weight"})
    return {"truncated": (str(truncated), "truncated"), "architecture": (llama, "'llama'"),
            "type": (f64, "blk.1.attn_norm.weight has type F64"), "missing": (missing, "blk.1.ffn_down.weight")}


def test_bad_input_names_culprit_and_writes_nothing(tiny_file, tmp_path):
    for case, (path, culprit) in broken_files(tiny_file, tmp_path).items():
        parent = tmp_path / f"out-{case}"
        parent.mkdir()
        with pytest.raises(CheckpointError) as err:
            import_gguf(path, parent / "hf", dtype="float32")
        assert path in str(err.value) and culprit in str(err.value), (case, str(err.value))
        assert os.listdir(parent) == [], case


# ------------------------------------------------------------------------------------------------ real 270M
@pytest.fixture(scope="module")
def real_import(tmp_path_factory):
    """(our float32 import of the real Gemma 3 270M GGUF, transformers' float32 folder of the same file)."""
    from real_gemma import gguf_path, reference_folder

    reference = reference_folder()
    return import_gguf(gguf_path(), tmp_path_factory.mktemp("gemma3-270m") / "hf", dtype="float32"), reference


@pytest.mark.slow
def test_real_270m_config_and_weights(real_import):
    from safetensors import safe_open

    folder, reference = real_import
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(reference, "config.json")) as g:
        ours, theirs = json.load(f), json.load(g)
    fields = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "layer_types",
              "rope_parameters", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
              "final_logit_softcapping", "tie_word_embeddings", "max_position_embeddings", "hidden_activation",
              "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert {k: ours.get(k, "absent") for k in fields} == {k: theirs.get(k, "absent") for k in fields}
    assert ModelConfig.from_file(folder) == ModelConfig.from_file(reference)
    with open(os.path.join(folder, "generation_config.json")) as f, \
            open(os.path.join(reference, "generation_config.json")) as g:
        ours, theirs = json.load(f), json.load(g)
    assert {k: ours.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
        {k: theirs.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    with safe_open(os.path.join(folder, "model.safetensors"), "numpy") as a, \
            safe_open(os.path.join(reference, "model.safetensors"), "numpy") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        differ = [k for k in b.keys() if not np.array_equal(a.get_tensor(k), b.get_tensor(k))]
    assert not differ, f"{len(differ)} tensors differ from transformers' dequantisation, e.g. {differ[:3]}"


@pytest.mark.slow
def test_real_270m_logits(real_import):
    folder, reference = real_import
    ids = transformers.AutoTokenizer.from_pretrained(reference)(mixed_text())["input_ids"][:320]
    assert len(ids) == 320
    ids = np.asarray([ids], dtype=np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    expected = torch_logits(model, ids)
    del model
    diff = max_abs_diff(ours_logits(folder, ids), expected)
    assert diff / float(np.abs(expected).max()) <= 1e-4, diff


@pytest.mark.slow
def test_real_270m_tokenizer(real_import):
    from tokenizers import Tokenizer
    from nnx_surgery.distill.inputs.batches import load_tokenizer

    folder, reference = real_import
    theirs = transformers.AutoTokenizer.from_pretrained(reference)
    text = mixed_text()
    pieces = [text] + text.split("\n\n")
    expected = [theirs(p)["input_ids"] for p in pieces]
    assert len(expected[0]) > 1000 and expected[0][0] == 2
    ours = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert [e.ids for e in ours.encode_batch(pieces)] == expected
    reloaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert [reloaded(p)["input_ids"] for p in pieces] == expected
    loaded = load_tokenizer(folder)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.add_bos) == (2, 1, 0, True)
    assert loaded.encode_batch(pieces[1:3]) == [ids[1:] for ids in expected[1:3]]
    with open(os.path.join(folder, "tokenizer.json")) as f, open(os.path.join(reference, "tokenizer.json")) as g:
        ours_json, theirs_json = json.load(f), json.load(g)
    assert ours_json["model"] == theirs_json["model"]  # vocabulary and merges: the same ids for any text
    assert ours_json["added_tokens"] == theirs_json["added_tokens"]


def test_load_pretrained_takes_a_gguf_path(tiny_file, tmp_path, monkeypatch):
    """`load_pretrained(x.gguf)` goes through the same cached import: equal to importing, then loading."""
    monkeypatch.setenv("NNX_SURGERY_CACHE", str(tmp_path / "cache"))
    _, path = tiny_file("gemma3_text")
    direct = np.asarray(load_pretrained(path)(jnp.asarray(IDS)).logits)
    imported = import_gguf(path, str(tmp_path / "folder"), dtype="float32")
    np.testing.assert_array_equal(direct, ours_logits(imported))
    assert load_pretrained(path, dtype="bfloat16").dtype == jnp.bfloat16
    assert sorted(os.listdir(tmp_path / "cache" / "gguf")) and len(os.listdir(tmp_path / "cache" / "gguf")) == 2
