"""Import a llama.cpp GGUF file as a Hugging Face folder: config, safetensors, tokenizer.

    folder = import_gguf("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", dtype="float32")
    folder = cached_import("gemma-3-270m-q4_k_m.gguf", "bfloat16")   # once per file and dtype, then cached

The folder is what transformers makes of the file (`from_pretrained(dir, gguf_file=name)`), so
`surgery.load_pretrained(folder)` gives its logits. The file's architecture names the family
(`families.BY_GGUF_ARCHITECTURE`); a family without a GGUF conversion (Llama's, see `Family.no_gguf`) is refused.
llama.cpp's conversion is undone as transformers undoes it: RMSNorm weights of a family with `norm_offset` were
stored as `1 + w` (w = stored - 1, in float32 after dequantisation, before the cast); the dequantised arrays (GGUF
lists dims innermost first) are already HF's `[out, in]`; a tied head is not stored, so a file with
`output.weight` is untied. Tensor names come from the family's schema (`schema.Tensor.gguf`).

The config takes every size and special-token id the file states (llama.cpp's common keys, read here) and the
family's own keys (`GGUFFormat.read`: e.g. Gemma's soft-caps, RoPE bases and layer pattern), with transformers'
config-class defaults for what the file does not state.

Tensors are dequantised with `gguf.quants.dequantize` one at a time (in row chunks, straight into the output)
while the previous one is written (`write_model_files`), into a temporary folder renamed into place at the end: a
checkpoint is never held twice and a failed import leaves nothing behind. Everything is checked (architecture,
sizes, tensor names, shapes, quantisation types, the file's length) before anything is written.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import resolve_dtype, torch_dtype_name
from ..modeling.model_config import ARCHITECTURES, ConfigError, ModelConfig
from ..families import BY_GGUF_ARCHITECTURE, GGUFKeys, without_gguf
from nnx_surgery.surgery.families.schema import bound_tensors, hf_shape_of
from .gguf_vocab_reader import build_tokenizer, tokenizer_configs
from .safetensors_stream import CheckpointError, PendingTensor, atomic_folder, write_json, write_model_files

DEQUANT_CHUNK_BYTES = 16 << 20  # float32 bytes dequantised at once


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `shape` in numpy (HF) order, innermost last, and where its bytes are."""

    name: str
    type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def rows(self, mapping: np.ndarray) -> np.ndarray:
        """The stored data as (rows, innermost) in the form `gguf.quants.dequantize` takes (and GGUFReader gives):
        float32/float16 values, or the bytes of each row's quantisation blocks."""
        from gguf import GGMLQuantizationType as Q

        raw = mapping[self.offset:self.offset + self.nbytes]
        values = {Q.F32: np.float32, Q.F16: np.float16}.get(self.type)
        if values is not None:
            return raw.view(values).reshape(-1, self.shape[-1])
        return raw.reshape(-1, self.nbytes // max(1, int(np.prod(self.shape[:-1], dtype=np.int64))))


@dataclass(frozen=True)
class GGUFTensorPlan:
    """One tensor to write: its HF name and shape, the GGUF tensor it comes from, and whether it is a norm."""

    hf_name: str
    shape: tuple[int, ...]
    source: GGUFTensor
    is_norm: bool


class GGUFFile:
    """The metadata (plain Python values) and tensor table of a little-endian GGUF v2/v3 file, parsed without
    materialising the arrays GGUFReader builds per token (for a 262k vocabulary they would dominate the header's
    memory and time; figures in bench/NOTES.md); tensor data is read through a read-only memory map only when a
    tensor is dequantised."""

    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
    STRING, ARRAY = 8, 9

    def __init__(self, path: str):
        self.path = path
        try:
            self.size = os.path.getsize(path)
            with open(path, "rb") as f:
                self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
        except OSError as err:
            raise CheckpointError(f"{path}: cannot be read ({err.strerror}).") from None
        if self.buffer[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it starts with {bytes(self.buffer[:4])!r}, not b'GGUF').")
        try:
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, KeyError) as err:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({self.size} bytes; {type(err).__name__}:"
                                  f" {err}); download or convert it again.") from None
        for tensor in self.tensors.values():
            if tensor.offset + tensor.nbytes > self.size:
                raise CheckpointError(f"{path}: truncated: tensor {tensor.name} ends at byte "
                                      f"{tensor.offset + tensor.nbytes}, the file has {self.size}; download or "
                                      "convert it again.")

    def _read(self, fmt: str):
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        if self.pos + length > self.size:
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        self.pos += length
        return bytes(self.buffer[self.pos - length:self.pos]).decode("utf-8")

    def _value(self, kind: int):
        if kind == self.STRING:
            return self._string()
        if kind != self.ARRAY:
            return self._read(self.SCALARS[kind])
        item, count = self._read("<I"), self._read("<Q")
        if item == self.STRING:
            return [self._string() for _ in range(count)]
        if item == self.ARRAY:
            return [self._value(self.ARRAY) for _ in range(count)]
        dtype = np.dtype(self.SCALARS[item])
        values = np.frombuffer(self.buffer, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return values.tolist()

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (byte-swapped or unknown); only little-endian v2/v3 files "
                             "are read")
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = self.pos + (-self.pos % alignment)
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, kind, offset in infos:
            kind = GGMLQuantizationType(kind)
            block, block_bytes = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims, dtype=np.int64))
            self.tensors[name] = GGUFTensor(name, kind, tuple(int(d) for d in reversed(dims)), start + offset,
                                            count // block * block_bytes)

    def mapping(self) -> np.ndarray:
        return np.frombuffer(self.buffer, np.uint8)


def hf_config_dict(metadata: dict[str, Any], tensor_names: set[str], where: str) -> dict[str, Any]:
    """The transformers config dict this file describes: llama.cpp's common keys, then the family's."""
    arch = metadata.get("general.architecture")
    if arch not in BY_GGUF_ARCHITECTURE:
        others = without_gguf()
        raise CheckpointError(f"{where}: architecture {arch!r} is not supported; expected one of "
                              f"{sorted(BY_GGUF_ARCHITECTURE)}" + (f" ({others})." if others else "."))
    family, model_type = BY_GGUF_ARCHITECTURE[arch]
    key = _CheckedKeys(metadata, arch, where)
    size = _Sizes(key, where)
    heads, hidden = size("attention.head_count"), size("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab = size("vocab_size", len(tokens) or None)
    config = dict(
        architectures=[ARCHITECTURES[model_type]], model_type=model_type, vocab_size=vocab,
        hidden_size=hidden, intermediate_size=size("feed_forward_length"),
        num_hidden_layers=size("block_count"), num_attention_heads=heads,
        num_key_value_heads=size("attention.head_count_kv", heads),
        head_dim=size("attention.key_length", max(1, hidden // heads)),
        rms_norm_eps=size.epsilon("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=size("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
    )
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("unk_token_id", "unknown_token_id"), ("pad_token_id", "padding_token_id")):
        value = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
                raise CheckpointError(f"{where}: tokenizer.ggml.{gguf_key} = {value!r} is not a token id below the "
                                      f"vocabulary size {vocab}; the file's metadata is corrupt.")
            config[name] = value
    gguf_format = family.gguf_format()  # BY_GGUF_ARCHITECTURE holds the families with one
    try:
        config.update(gguf_format.read(model_type, key, config))
    except (ArithmeticError, ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: the {arch} metadata makes no sense ({type(err).__name__}: {err}); the "
                              "file's header is corrupt: convert or download it again.") from None
    _check_positive(config, where, arch)
    return config


def _check_positive(values: dict[str, Any], where: str, arch: str) -> None:
    """Every number of the config (RoPE bases, soft-caps, the sliding window...) finite and above 0, token ids
    aside: a zero, negative or infinite one is a corrupt header, not a model."""
    for name, value in values.items():
        if isinstance(value, dict):
            _check_positive(value, where, arch)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith("_token_id") \
                and not (0 < value < math.inf):
            raise CheckpointError(f"{where}: the {arch} metadata gives {name} = {value!r}, which must be a finite "
                                  "number above 0; the file's header is corrupt: convert or download it again.")


MAX_SIZE = 1 << 24  # a size in a GGUF header above this (16M) is corrupt, not a model


class _CheckedKeys(GGUFKeys):
    """GGUFKeys whose numbers (what a family reads: RoPE bases, soft-caps, windows, periods) are refused, naming
    the key, unless finite and above 0 (a whole number up to MAX_SIZE for an integer)."""

    def __call__(self, name: str, default: Any = KeyError) -> Any:
        value = super().__call__(name, default)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and value is not default
        if number and not (0 < value < math.inf and (isinstance(value, float) or value <= MAX_SIZE)):
            raise CheckpointError(f"{self.where}: {self.arch}.{name} = {value!r} must be a finite number above 0"
                                  f"{'' if isinstance(value, float) else f' and at most {MAX_SIZE:,}'}; the file's "
                                  "header is corrupt: convert or download it again.")
        return value


class _Sizes:
    """The header's sizes, each a whole number in [1, MAX_SIZE], else a CheckpointError naming the
    key: a zero, negative, huge or non-finite size would divide by zero or allocate without bound later."""

    def __init__(self, key: GGUFKeys, where: str):
        self.key, self.where = key, where

    def __call__(self, name: str, default: Any = KeyError) -> int:
        value = self.key(name, default)
        if value is None:
            raise CheckpointError(f"{self.where}: neither {self.key.arch}.{name} nor tokenizer.ggml.tokens gives "
                                  "it; the file is incomplete.")
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole or not 1 <= value <= MAX_SIZE:
            raise CheckpointError(f"{self.where}: {self.key.arch}.{name} = {value!r} is not a size (a whole number "
                                  f"from 1 to {MAX_SIZE:,}); the file's header is corrupt: convert or download it "
                                  "again.")
        return int(value)

    def epsilon(self, name: str) -> float:
        value = self.key(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise CheckpointError(f"{self.where}: {self.key.arch}.{name} = {value!r} is not an epsilon in (0, 1); "
                                  "the file's header is corrupt: convert or download it again.")
        return float(value)


def import_tensor_plans(config: ModelConfig, file: GGUFFile) -> list[GGUFTensorPlan]:
    """Every HF tensor of `config` (in transformers' order), matched to its GGUF tensor, shape and type checked;
    GGUF tensors left over are an error too (a file this mapping does not describe)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    readable = set(_type_traits) | {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    left, plans = dict(file.tensors), []
    for tensor in bound_tensors(config):
        name, shape = tensor.gguf_name, hf_shape_of(config, tensor)
        found = left.pop(name, None)
        if found is None:
            raise CheckpointError(f"{file.path}: tensor {name} (for {tensor.hf_name}) is missing; the file does "
                                  f"not hold a complete {config.model_type} model.")
        if found.shape != shape:
            raise CheckpointError(f"{file.path}: tensor {name} has shape {list(found.shape)}, the metadata implies "
                                  f"{list(shape)} (for {tensor.hf_name}).")
        if found.type not in readable:
            raise CheckpointError(f"{file.path}: tensor {name} has type {found.type.name}, which gguf.quants "
                                  "cannot dequantise; re-quantise the model to a supported type (F32, F16, BF16, "
                                  "Q4_0..Q8_0, Q2_K..Q6_K, IQ*).")
        # llama.cpp stores offset RMSNorm weights (Gemma's) as 1 + w
        plans.append(GGUFTensorPlan(tensor.hf_name, shape, found, tensor.decl.norm and config.norm_offset))
    if left:
        raise CheckpointError(f"{file.path}: {len(left)} tensor(s) a {config.model_type} model does not use, e.g. "
                              f"{sorted(left)[:3]}; this is not a plain {config.family.name} text model.")
    return plans


def pending_tensor(plan: GGUFTensorPlan, file: GGUFFile, dtype: np.dtype,
                   chunk_bytes: int = DEQUANT_CHUNK_BYTES) -> PendingTensor:
    """Dequantised to float32, the norm offset removed in float32, cast to `dtype`: when its turn to be written
    comes, and not before. Rows are dequantised a chunk at a time straight into the output (a quantisation block
    never spans two rows, so this is exactly `gguf.quants.dequantize` of the whole tensor): the only full-size
    buffer is the result, in `dtype`."""
    from gguf.quants import dequantize

    source = plan.source

    def produce() -> np.ndarray:
        data = source.rows(file.mapping())
        out = np.empty(plan.shape, dtype).reshape(data.shape[0], -1)
        step = max(1, chunk_bytes // max(1, 4 * out.shape[1]))
        try:
            for start in range(0, data.shape[0], step):
                values = dequantize(data[start:start + step], source.type)
                if plan.is_norm:
                    values = values.astype(np.float32) - np.float32(1.0)
                out[start:start + step] = values.reshape(-1, out.shape[1])
        except Exception as err:
            raise CheckpointError(f"{file.path}: tensor {source.name} ({source.type.name}) could not be "
                                  f"dequantised ({type(err).__name__}: {err}).") from None
        return out.reshape(plan.shape)

    return PendingTensor(plan.hf_name, plan.shape, dtype, produce)


def resolve_gguf_dtype(dtype) -> np.dtype:
    resolved = resolve_dtype(dtype)
    if resolved is None:
        raise ValueError(f"dtype {dtype!r}: a GGUF import needs an explicit float32, bfloat16 or float16.")
    return resolved


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype="bfloat16",
                overwrite: bool = False) -> str:
    """Write the GGUF model at `gguf_path` as an HF folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json, generation_config.json) at `out_dir`; returns its absolute
    path. Raises CheckpointError (naming the file, and the tensor or key) for a truncated or foreign file, an
    unsupported architecture or tensor type, or missing tensors, before anything is written. A non-empty `out_dir`
    is refused unless `overwrite=True` (then replaced once the new folder is complete)."""
    path, out_dir = os.path.abspath(os.fspath(gguf_path)), os.fspath(out_dir)
    out_dtype = resolve_gguf_dtype(dtype)
    file = GGUFFile(path)
    metadata = file.metadata
    if int(metadata.get("split.count", 1)) > 1:
        raise CheckpointError(f"{path}: part of a split GGUF ({metadata['split.count']} files); merge the parts "
                              "first (llama.cpp's `llama-gguf-split --merge`).")
    blocks = metadata.get(f"{metadata.get('general.architecture')}.block_count")
    if isinstance(blocks, int) and blocks > len(file.tensors):  # before a list of that many layers is made
        raise CheckpointError(f"{path}: block_count = {blocks} but the file holds {len(file.tensors)} tensors; the "
                              "file's header is corrupt: convert or download it again.")
    config_dict = hf_config_dict(metadata, set(file.tensors), path)
    try:
        config = ModelConfig.from_hf_dict(config_dict, where=f"{path} (metadata)")
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    plans = import_tensor_plans(config, file)
    tokenizer = build_tokenizer(metadata, path)
    tokenizer_config, special_map = tokenizer_configs(metadata, list(metadata["tokenizer.ggml.tokens"]), path)
    generation = {"_from_model_config": True, **{k: config_dict[k] for k in
                                                  ("bos_token_id", "eos_token_id", "pad_token_id") if k in config_dict}}
    with atomic_folder(out_dir, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as handle:
            handle.write(tokenizer.to_str(pretty=True))  # Python's write: a full disk is an OSError (ENOSPC)
        del tokenizer  # its vocabulary and merges are not kept alongside the largest tensor
        write_model_files(tmp, [pending_tensor(p, file, out_dtype) for p in plans], "5GB")
        write_json(os.path.join(tmp, "config.json"), config.to_hf_dict(dtype=torch_dtype_name(out_dtype)))
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
