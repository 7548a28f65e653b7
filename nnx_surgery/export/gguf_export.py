"""Export a Hugging Face model folder (any shape the surgery makes) as one GGUF file llama.cpp runs.

    export_gguf("out/student", "student-q8_0.gguf", dtype="q8_0")

The conventions are llama.cpp's converter's (convert_hf_to_gguf.py), whose files llama.cpp's loader expects; this
is the inverse of the GGUF import (gguf_import.py). The family's GGUF conversion (`Family.gguf`) supplies what differs by
family: the llama.cpp architecture, what its graph cannot run (refused before anything is written), its metadata
keys, the query scale and the default context length. A family without one (Llama's) is refused. The rest is
common:

* tensor names from the family schema (`schema.Tensor.gguf`); GGUF lists dimensions innermost first, so an HF
  `[out, in]` matrix is written as is;
* RMSNorm weights of a family with `norm_offset` as `1 + w` (llama.cpp multiplies by the stored weight alone), in
  float32; a tied head is not written (llama.cpp reuses `token_embd.weight`);
* 1-D tensors and norms stay F32; matrices take `dtype`, except that a block type falls back to F16 for a tensor
  whose rows are not a whole number of blocks (as the converter does);
* the common metadata: sizes, head counts, key/value lengths (head_dim), RMS epsilon, the full layers' RoPE base and
  linear scaling; then the family's keys (`GGUFFormat.write`);
* the queries times `GGUFFormat.query_scale` (into the q_norm weight when the model normalises queries before RoPE,
  else into q_proj's rows), which RoPE and the dot product carry linearly;
* the tokenizer as llama.cpp's SentencePiece vocabulary (gguf_vocab_writer.py).

Tensors are read one at a time from the safetensors files and converted a chunk of rows at a time into the output
buffer, so the only full-size buffer is the tensor being written. The file is written to a temporary name beside
`path` and renamed into place at the end; a failure leaves neither.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import TYPE_CHECKING

import numpy as np

from nnx_surgery.surgery.storage.atomic import atomic_file
from nnx_surgery.surgery.modeling.model_config import FULL, ModelConfig
from nnx_surgery.surgery.families import BY_GGUF_ARCHITECTURE, without_gguf
from nnx_surgery.export.gguf_vocab_writer import GGUFVocabulary, add_to_writer, read_vocabulary
from nnx_surgery.surgery.storage.safetensors_stream import (DTYPE_CODES, CheckpointError, checkpoint_weight_map,
                                                            open_safetensors)
from nnx_surgery.surgery.families.schema import BoundTensor, bound_tensors, hf_shape_of

if TYPE_CHECKING:  # gguf is an optional dependency, imported where a file is written
    from gguf import GGMLQuantizationType

# HF model_type -> llama.cpp architecture, for the families with a GGUF conversion.
ARCHITECTURES = {model_type: arch for arch, (_, model_type) in BY_GGUF_ARCHITECTURE.items()}
# dtype name -> (GGML type of the matrices, general.file_type); types gguf.quants quantises in Python.
EXPORT_DTYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
                 "q8_0": ("Q8_0", "MOSTLY_Q8_0"), "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
                 "q4_1": ("Q4_1", "MOSTLY_Q4_1"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
REFUSED_DTYPES = {
    "tq1_0": "a ternary type for BitNet-trained weights; it would destroy a model not trained in it",
    "tq2_0": "a ternary type for BitNet-trained weights; it would destroy a model not trained in it",
    "mxfp4": "llama.cpp's converter writes it only for checkpoints trained in it (MoE experts)",
    "nvfp4": "llama.cpp's converter writes it only for checkpoints trained in it",
}
CHUNK_BYTES = 32 << 20  # float32 bytes converted at once


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One GGUF tensor: its name, HF source and shape, GGML type, and what is done to the values first (the norm
    offset added; the queries scaled by `scale`)."""

    name: str
    hf_name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    add_one: bool
    scale: float

    @property
    def byte_shape(self) -> tuple[int, ...]:
        from gguf import GGML_QUANT_SIZES
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return (math.prod(self.shape[:-1]), self.shape[-1] // block * block_bytes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.byte_shape)


def export_gguf(folder: str | os.PathLike, path: str | os.PathLike, *, dtype: str = "f16") -> str:
    """Write the model in the HF `folder` (config.json, safetensors, tokenizer.json) as a GGUF file at
    `path` (replaced atomically if it exists); returns its absolute path. `dtype`: the matrices' type, one of
    EXPORT_DTYPES (norms and 1-D tensors stay f32). Raises ValueError for an unknown dtype and CheckpointError
    (or ConfigError) naming the file and what to do for a folder this cannot export, before writing anything."""
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType[resolve_export_dtype(dtype)[0]]
    folder, path = os.path.abspath(os.fspath(folder)), os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(f"{folder}: no config.json; export_gguf takes a Hugging Face model folder (what "
                              "save_student / save_pretrained write).")
    config = ModelConfig.from_file(folder)
    arch = check_exportable(config, folder)
    weight_map = checkpoint_weight_map(folder)
    plans = export_tensor_plans(config, weight_map, qtype, folder)
    vocab = read_vocabulary(folder, config.vocab_size)
    with atomic_file(path) as tmp:
        write_gguf(tmp, folder, config, arch, vocab, plans, weight_map, dtype)
    return path


def resolve_export_dtype(dtype) -> tuple[str, str]:
    name = dtype.lower() if isinstance(dtype, str) else None
    if name in EXPORT_DTYPES:
        return EXPORT_DTYPES[name]
    choices = ", ".join(EXPORT_DTYPES)
    if name in REFUSED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not offered: {REFUSED_DTYPES[name]}. Choose one of {choices}.")
    raise ValueError(f"dtype {dtype!r} is not supported; choose one of {choices}. K-quants and IQ types (q4_k_m, "
                     "...) have no Python quantiser: export f16 or bf16 and run llama.cpp's llama-quantize.")


def check_exportable(config: ModelConfig, folder: str) -> str:
    """The llama.cpp architecture for `config`, or a CheckpointError for what its family's GGUF conversion cannot
    write (no conversion, or what llama.cpp's graph for the model type cannot run)."""
    where = os.path.join(folder, "config.json")
    if config.model_type not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {config.model_type!r}: GGUF export writes "
                              f"{', '.join(ARCHITECTURES)} only ({without_gguf()}); convert this folder with "
                              "llama.cpp's convert_hf_to_gguf.py.")
    config.family.gguf_format().check(config, where)
    return ARCHITECTURES[config.model_type]


def export_tensor_plans(config: ModelConfig, weight_map: dict[str, str], qtype, folder: str) -> list[ExportTensor]:
    """Every tensor to write, its source checked against the checkpoint (present, shaped as config.json says)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()  # a tied head some writers still save
    expected = {t.hf_name for t in bound_tensors(config)} | ignored
    unknown = sorted(set(weight_map) - expected)
    if unknown:
        raise CheckpointError(f"{folder}: {len(unknown)} tensor(s) a {config.model_type} model does not have, e.g. "
                              f"{unknown[:3]}; this is not a plain {config.model_type} checkpoint.")
    shapes = stored_shapes(folder, weight_map)
    scale, plans = config.family.gguf_format().query_scale(config), []
    for tensor in bound_tensors(config):
        shape = hf_shape_of(config, tensor)
        if tensor.hf_name not in shapes:
            raise CheckpointError(f"{folder}: tensor {tensor.hf_name} is missing; the checkpoint is incomplete.")
        if shapes[tensor.hf_name] != shape:
            raise CheckpointError(f"{folder}: tensor {tensor.hf_name} has shape {list(shapes[tensor.hf_name])}, "
                                  f"config.json implies {list(shape)}.")
        kind = Q.F32 if len(shape) == 1 or tensor.decl.norm else qtype
        if shape[-1] % GGML_QUANT_SIZES[kind][0]:
            kind = Q.F16  # llama.cpp's converter: rows that are no whole number of blocks
        plans.append(ExportTensor(tensor.gguf_name, tensor.hf_name, shape, kind,
                                  tensor.decl.norm and config.norm_offset, _query_factor(config, tensor, scale)))
    return plans


def _query_factor(config: ModelConfig, tensor: BoundTensor, scale: float) -> float:
    """A model that normalises the queries (q_norm) before RoPE takes the scale in that weight, others in q_proj."""
    target = "q_norm" if config.uses_qk_norm else "q_proj"
    return scale if tensor.module == target else 1.0


def stored_shapes(folder: str, weight_map: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Each tensor's stored shape, its dtype checked to be a float type this reads."""
    shapes = {}
    for file_name in sorted(set(weight_map.values())):
        with open_safetensors(os.path.join(folder, file_name)) as f:
            for name in f.keys():
                if weight_map.get(name) != file_name:
                    continue
                stored = f.get_slice(name)
                if stored.get_dtype() not in DTYPE_CODES:
                    raise CheckpointError(f"{folder}/{file_name}: tensor {name} has dtype {stored.get_dtype()}; "
                                          "expected F32, BF16, F16 or F64.")
                shapes[name] = tuple(stored.get_shape())
    return shapes


def write_gguf(tmp: str, folder: str, config: ModelConfig, arch: str, vocab: GGUFVocabulary,
               plans: list[ExportTensor], weight_map: dict[str, str], dtype: str) -> None:
    """Metadata and tensor table first, then the tensors one at a time in that order."""
    import gguf

    writer = gguf.GGUFWriter(tmp, arch)
    try:
        add_model_metadata(writer, config, os.path.basename(folder), gguf.LlamaFileType[resolve_export_dtype(dtype)[1]])
        add_to_writer(writer, vocab)
        for plan in plans:
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with contextlib.ExitStack() as stack:
            files = {}
            for plan in plans:
                file_name = weight_map[plan.hf_name]
                if file_name not in files:
                    files[file_name] = stack.enter_context(open_safetensors(os.path.join(folder, file_name)))
                writer.write_tensor_data(converted(plan, files[file_name]))
    finally:
        writer.close()


def converted(plan: ExportTensor, file) -> np.ndarray:
    """The tensor's GGUF bytes: read in chunks of rows, in float32 the norm offset added and the queries scaled,
    then quantised with `gguf.quants.quantize` (a block never spans two rows, so chunking changes nothing)."""
    from gguf.quants import quantize

    source = file.get_slice(plan.hf_name)
    rows, width = plan.byte_shape[0], plan.shape[-1]
    out = np.empty(plan.byte_shape, np.uint8)
    step = max(1, CHUNK_BYTES // (4 * width))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        stored = source.read_rows(start, stop) if len(plan.shape) > 1 else source.read_rows(0, width)
        values = np.asarray(stored, dtype=np.float32).reshape(stop - start, width)
        if plan.add_one:
            values = values + np.float32(1.0)
        if plan.scale != 1.0:
            values = values * np.float32(plan.scale)
        out[start:stop] = np.ascontiguousarray(quantize(values, plan.qtype)).view(np.uint8).reshape(stop - start, -1)
    return out


def add_model_metadata(writer, config: ModelConfig, name: str, file_type) -> None:
    """general.* and `<arch>.*` keys, as llama.cpp's converter writes them for this model type: the common ones,
    then the family's (`GGUFFormat.write`)."""
    from gguf import GGML_QUANT_VERSION, RopeScalingType

    gguf_format = config.family.gguf_format()
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(int(config.raw.get("max_position_embeddings")
                                  or gguf_format.context_lengths[config.model_type]))
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    full = config.rope[FULL]
    writer.add_rope_freq_base(full.theta)
    if full.linear_factor != 1.0:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full.linear_factor)
    gguf_format.write(writer, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(GGML_QUANT_VERSION)


__all__ = ["export_gguf", "EXPORT_DTYPES"]
