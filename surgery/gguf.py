"""Import a llama.cpp GGUF Gemma (1, 2 or 3) as a Hugging Face folder: config, safetensors, tokenizer.

    folder = import_gguf("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", dtype="float32")
    folder = cached_import("gemma-3-270m-q4_k_m.gguf", "bfloat16")   # once per file and dtype, then cached

The folder is what transformers itself makes of the file (`from_pretrained(dir, gguf_file=name)`), so
`surgery.load_pretrained(folder)` gives its logits. What llama.cpp's converter changed is undone as transformers
undoes it:

* every RMSNorm weight was stored as `1 + w` (llama.cpp's RMSNorm does not add the 1): `w` is the stored value
  minus one, computed in float32 after dequantisation and before the cast to `dtype`;
* GGUF lists shapes innermost first; the dequantised arrays are already in HF's `[out, in]` layout, and Gemma's
  q/k projections are stored unpermuted (llama.cpp permutes them for Llama only);
* the tied LM head is not stored: a file with `output.weight` has an untied head (`tie_word_embeddings=false`).

The config takes every size the file states (`{arch}.*` keys), the special-token ids, and, for what the file does
not state, transformers' config-class defaults: `query_pre_attn_scalar` 256, the sliding RoPE base 10000 (Gemma 3),
the layer pattern (Gemma 2 alternates, Gemma 3 has one full layer in six). Two facts the file can state and
transformers 5.24 drops are kept, because they change the model the file describes (llama.cpp applies them):
Gemma 2's soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`) and Gemma 3's linear RoPE scaling
(`rope.scaling.*`, full-attention layers only). Released Gemma 2 files state the soft-caps transformers assumes
(50, 30), and Gemma 3 270M/1B have no scaling, so for them the two configs are identical. transformers has no
GGUF support for Gemma 1 (`gemma`); its config is built the same way from the same keys.

Tensors are dequantised with `gguf.quants.dequantize` one at a time while the previous one is written
(`write_model_files`), into a temporary folder renamed into place at the end: a checkpoint is never held twice and
a failed import leaves nothing behind. Everything is checked (architecture, sizes, tensor names, shapes and
quantisation types) before anything is written.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .config import ARCHITECTURES, ConfigError, GemmaConfig
from .gguf_tokenizer import build_tokenizer, tokenizer_configs
from .safetensors_io import (CheckpointError, PendingTensor, atomic_folder, write_json, write_model_files)

MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}
DTYPES = {"float32": np.float32, "fp32": np.float32, "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
          "float16": np.float16, "fp16": np.float16, "half": np.float16}
# Per-layer tensors: HF name -> llama.cpp name (gguf's TensorNameMap for each architecture).
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class GGUFTensorPlan:
    """One tensor to write: its HF name and shape, the GGUF tensor it comes from, and whether it is a norm."""

    hf_name: str
    shape: tuple[int, ...]
    source: Any  # gguf.ReaderTensor
    is_norm: bool


def read_gguf(path: str):
    """A `gguf.GGUFReader` over `path`; a missing, foreign or truncated file is a CheckpointError naming it."""
    from gguf import GGUFReader

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror}).") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF').")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader fails on short arrays in many ways (ValueError, IndexError, ...)
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({size} bytes; {type(err).__name__}: "
                              f"{err}); download or convert it again.") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != int(tensor.n_bytes):
            raise CheckpointError(f"{path}: truncated: tensor {tensor.name} needs {int(tensor.n_bytes)} bytes, the "
                                  f"file holds {tensor.data.nbytes}; download or convert it again.")
    return reader


def gguf_metadata(reader) -> dict[str, Any]:
    """Every key-value pair of the file as plain Python values (strings decoded, arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config_dict(metadata: dict[str, Any], tensor_names: set[str], where: str) -> dict[str, Any]:
    """The transformers config dict this file describes (see the module docstring for the choices)."""
    arch = metadata.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise CheckpointError(f"{where}: architecture {arch!r} is not supported; expected one of "
                              f"{sorted(MODEL_TYPES)} (Gemma 1, 2, 3 text models).")
    model_type = MODEL_TYPES[arch]

    def key(name: str, default: Any = KeyError) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise CheckpointError(f"{where}: metadata key {arch}.{name} is missing; the file is incomplete.")
        return value

    heads = int(key("attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab = key("vocab_size", None) or len(tokens)
    if not vocab:
        raise CheckpointError(f"{where}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary "
                              "size.")
    config = dict(
        architectures=[ARCHITECTURES[model_type]], model_type=model_type, vocab_size=int(vocab),
        hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", int(key("embedding_length")) // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_activation="gelu_pytorch_tanh",
    )
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("unk_token_id", "unknown_token_id"), ("pad_token_id", "padding_token_id")):
        if metadata.get(f"tokenizer.ggml.{gguf_key}") is not None:
            config[name] = int(metadata[f"tokenizer.ggml.{gguf_key}"])
    if model_type == "gemma":
        config["hidden_act"] = "gelu_pytorch_tanh"
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
        return config
    config.update(query_pre_attn_scalar=256, sliding_window=int(key("attention.sliding_window", 4096)))
    if model_type == "gemma2":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
        config["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
        config["layer_types"] = _layer_types(metadata, arch, config["num_hidden_layers"], 2)
        return config
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1_000_000.0))}
    scaling = key("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"{where}: {arch}.rope.scaling.type={scaling!r}; Gemma 3 uses 'linear' only.")
        full.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    config["rope_parameters"] = {"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    config.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    config["layer_types"] = _layer_types(metadata, arch, config["num_hidden_layers"], 6)
    return config


def _layer_types(metadata: dict, arch: str, num_layers: int, default_pattern: int) -> list[str]:
    """Sliding/full per layer: `{arch}.attention.sliding_window_pattern` (a period, or one flag per layer, True
    = sliding) when the file has it, else every `default_pattern`-th layer full (transformers' default)."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]


def tensor_plans(config: GemmaConfig, reader, where: str) -> list[GGUFTensorPlan]:
    """Every HF tensor of `config`, matched to its GGUF tensor, shape and type checked; extra GGUF tensors are an
    error too (a file this mapping does not describe)."""
    from gguf.quants import _type_traits
    from gguf import GGMLQuantizationType

    readable = set(_type_traits) | {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    by_name = {t.name: t for t in reader.tensors}
    plans = []
    for hf_name, shape, gguf_name in _hf_tensors(config):
        tensor = by_name.pop(f"{gguf_name}.weight", None)
        if tensor is None:
            raise CheckpointError(f"{where}: tensor {gguf_name}.weight (for {hf_name}) is missing; the file does not "
                                  f"hold a complete {config.model_type} model.")
        found = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if found != shape:
            raise CheckpointError(f"{where}: tensor {tensor.name} has shape {list(found)}, the metadata implies "
                                  f"{list(shape)} (for {hf_name}).")
        if tensor.tensor_type not in readable:
            raise CheckpointError(f"{where}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                                  "gguf.quants cannot dequantise; re-quantise the model to a supported type "
                                  "(F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ*).")
        plans.append(GGUFTensorPlan(hf_name, shape, tensor, gguf_name.endswith("norm")))
    if by_name:
        raise CheckpointError(f"{where}: {len(by_name)} tensor(s) a {config.model_type} model does not use, e.g. "
                              f"{sorted(by_name)[:3]}; this is not a plain Gemma text model.")
    return plans


def _hf_tensors(config: GemmaConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, HF shape, GGUF base name) in the order transformers writes them."""
    d, f, h, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    q, kv = config.num_attention_heads * h, config.num_key_value_heads * h
    shapes = {"input_layernorm": (d,), "self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d),
              "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q), "self_attn.q_norm": (h,),
              "self_attn.k_norm": (h,), "post_attention_layernorm": (d,), "pre_feedforward_layernorm": (d,),
              "post_feedforward_layernorm": (d,), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
              "mlp.down_proj": (d, f)}
    # Gemma 1's only post-attention norm is the pre-MLP norm; llama.cpp calls it ffn_norm.
    layer_names = dict(LAYER_TENSORS, post_attention_layernorm="ffn_norm" if config.model_type == "gemma"
                       else "post_attention_norm")
    wanted = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    wanted += ["self_attn.q_norm", "self_attn.k_norm"] if config.uses_qk_norm else []
    wanted += ["post_attention_layernorm"]
    wanted += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if config.uses_sandwich_norms else []
    wanted += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    out = [("model.embed_tokens.weight", (v, d), GLOBAL_TENSORS["model.embed_tokens"])]
    for i in range(config.num_hidden_layers):
        out += [(f"model.layers.{i}.{name}.weight", shapes[name], f"blk.{i}.{layer_names[name]}") for name in wanted]
    out.append(("model.norm.weight", (d,), GLOBAL_TENSORS["model.norm"]))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (v, d), GLOBAL_TENSORS["lm_head"]))
    return out


def pending_tensor(plan: GGUFTensorPlan, dtype: np.dtype, where: str) -> PendingTensor:
    """Dequantised (float32), the norm offset removed in float32, cast to `dtype`: when its turn to be written
    comes, and not before."""
    from gguf.quants import dequantize

    def produce() -> np.ndarray:
        try:
            values = dequantize(plan.source.data, plan.source.tensor_type)
        except Exception as err:
            raise CheckpointError(f"{where}: tensor {plan.source.name} ({plan.source.tensor_type.name}) could not be "
                                  f"dequantised ({type(err).__name__}: {err}).") from None
        values = values.reshape(plan.shape)
        if plan.is_norm:
            values = values.astype(np.float32) - np.float32(1.0)
        return values.astype(dtype, copy=False)

    return PendingTensor(plan.hf_name, plan.shape, dtype, produce)


def resolve_gguf_dtype(dtype) -> np.dtype:
    name = dtype.lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported for a GGUF import; use float32, bfloat16 or float16.")
    return np.dtype(DTYPES[name])


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype="bfloat16") -> str:
    """Write the GGUF Gemma at `gguf_path` as an HF folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json, generation_config.json) at `out_dir`; returns its absolute
    path. Raises CheckpointError (naming the file, and the tensor or key) for a truncated or foreign file, an
    unsupported architecture or tensor type, or missing tensors, before anything is written."""
    path, out_dir = os.path.abspath(os.fspath(gguf_path)), os.fspath(out_dir)
    out_dtype = resolve_gguf_dtype(dtype)
    reader = read_gguf(path)
    metadata = gguf_metadata(reader)
    config_dict = hf_config_dict(metadata, {t.name for t in reader.tensors}, path)
    try:
        config = GemmaConfig.from_hf_dict(config_dict, where=f"{path} (metadata)")
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    plans = tensor_plans(config, reader, path)
    tokenizer = build_tokenizer(metadata, path)
    tokenizer_config, special_map = tokenizer_configs(metadata, list(metadata["tokenizer.ggml.tokens"]), path)
    torch_dtype = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                   np.dtype(np.float16): "float16"}[out_dtype]
    generation = {"_from_model_config": True, **{k: config_dict[k] for k in
                                                  ("bos_token_id", "eos_token_id", "pad_token_id") if k in config_dict}}
    with atomic_folder(out_dir) as tmp:
        write_model_files(tmp, [pending_tensor(p, out_dtype, path) for p in plans], "5GB")
        write_json(os.path.join(tmp, "config.json"), config.to_hf_dict(dtype=torch_dtype))
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        write_json(os.path.join(tmp, "tokenizer_config.json"), tokenizer_config)
        write_json(os.path.join(tmp, "special_tokens_map.json"), special_map)
        write_json(os.path.join(tmp, "generation_config.json"), generation)
    return os.path.abspath(out_dir)


def cache_root() -> str:
    return os.path.join(os.environ.get("NNX_SURGERY_CACHE", os.path.expanduser("~/.cache/nnx-surgery")), "gguf")


def cached_import(gguf_path: str | os.PathLike, dtype="bfloat16") -> str:
    """The HF folder of `gguf_path` in `dtype`, imported once and cached under `$NNX_SURGERY_CACHE/gguf/` (default
    ~/.cache/nnx-surgery), keyed by the file's resolved path, size, modification time and the dtype: a changed
    file is imported again. The folder appears atomically, so one that exists is complete."""
    path = os.path.realpath(os.fspath(gguf_path))
    try:
        stat = os.stat(path)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror}).") from None
    out_dtype = resolve_gguf_dtype(dtype)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{out_dtype.name}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(cache_root(), f"{stem}-{out_dtype.name}-{key}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    return import_gguf(path, folder, dtype=out_dtype)
