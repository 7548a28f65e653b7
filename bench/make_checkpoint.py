"""Write a random-weight Hugging Face Gemma checkpoint of a real shape, streaming, one tensor at a time.

    python bench/make_checkpoint.py gemma-7b /tmp/ckpt/gemma-7b            # bf16, 5 GB shards like the Hub
    python bench/make_checkpoint.py gemma-3-270m OUT --dtype float32 --set num_hidden_layers=4
    python bench/make_checkpoint.py --hub-copy-of /tmp/ckpt/gemma-7b /tmp/ckpt/gemma-7b-hub  # same tensors, Hub layout

Shapes are the real configs (shared/research/hf_nnx.md §1.4); names and layouts come from
`surgery.storage.hf_checkpoint.tensor_table`, config.json from `ModelConfig.to_hf_dict`, and the files are written by
`surgery.storage.safetensors_stream.write_model_files`, which asks each tensor for its data only when its turn comes. The
weights are produced in row blocks straight into the output array, so peak memory is the largest tensor (the
embedding, 1.6 GB for gemma-7b) plus a few MB, whatever the model's size.

Values: bf16 bit patterns with a random sign, exponent 2^-7 or 2^-6 and random mantissa, i.e. |w| in
[0.0078, 0.031) (RMS ~0.018, close to transformers' normal(0, 0.02) init). Making them from raw random bytes runs at
memory speed, unlike a Gaussian sampler. Every tensor's stream is seeded from (seed, its name): a checkpoint is
reproducible, and two tensors never share values. Norm weights get the same small values (1 + w ~ 1).

Our writer pads the header so that tensor data starts 64-byte aligned (loads can then map it without copying).
Files written by the safetensors library, transformers or the Hub pad it to 8 bytes only and sort each file's
tensors by name: `copy_with_layout(src, out, "hub")` rewrites a checkpoint that way (header byte-identical to the
library's `save_file` for the same tensors and metadata), choosing the metadata so that the data is *not* 64-byte
aligned, the case 7 Hub files in 8 are in; "aligned" rewrites one as our writer lays files out.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nnx_surgery.surgery.storage.hf_checkpoint import hf_shape, tensor_table  # noqa: E402
from nnx_surgery.surgery.modeling.model_config import ModelConfig  # noqa: E402
from nnx_surgery.surgery.modeling.causal_lm import abstract_model  # noqa: E402
from nnx_surgery.surgery.storage.safetensors_stream import (PendingTensor, atomic_folder, write_json, write_model_files)  # noqa: E402

_GEMMA1 = dict(model_type="gemma", architectures=["GemmaForCausalLM"], hidden_act="gelu_pytorch_tanh",
               hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
               rope_theta=10000.0, vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_GEMMA2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
               max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=256000,
               query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_GEMMA3 = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
               max_position_embeddings=32768, rms_norm_eps=1e-6, vocab_size=262144, query_pre_attn_scalar=256,
               sliding_window=512, final_logit_softcapping=None, attn_logit_softcapping=None,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
               bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _dims(layers, hidden, inter, heads, kv, head_dim, **extra):
    return dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, **extra)


def _alternating(layers: int) -> list[str]:  # Gemma 2: sliding, full, sliding, ...
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _every_sixth(layers: int) -> list[str]:  # Gemma 3: five sliding, then one full
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


# Real shapes (hf_nnx.md §1.4; parameter counts there checked against transformers on the meta device).
SHAPES: dict[str, dict] = {
    "gemma-2b": {**_GEMMA1, **_dims(18, 2048, 16384, 8, 1, 256)},
    "gemma-7b": {**_GEMMA1, **_dims(28, 3072, 24576, 16, 16, 256)},
    "gemma-2-2b": {**_GEMMA2, **_dims(26, 2304, 9216, 8, 4, 256), "layer_types": _alternating(26)},
    "gemma-2-9b": {**_GEMMA2, **_dims(42, 3584, 14336, 16, 8, 256), "layer_types": _alternating(42)},
    "gemma-3-270m": {**_GEMMA3, **_dims(18, 640, 2048, 4, 1, 256), "layer_types": _every_sixth(18)},
    "gemma-3-1b": {**_GEMMA3, **_dims(26, 1152, 6912, 4, 1, 256), "layer_types": _every_sixth(26)},
    # Tiny shapes for tests and smoke runs (same families, same code paths).
    "tiny-gemma": {**_GEMMA1, **_dims(4, 64, 128, 4, 2, 16), "vocab_size": 512},
    "tiny-gemma2": {**_GEMMA2, **_dims(4, 64, 128, 4, 2, 16), "vocab_size": 512, "sliding_window": 8,
                    "query_pre_attn_scalar": 16, "layer_types": _alternating(4)},
    "tiny-gemma3": {**_GEMMA3, **_dims(6, 64, 128, 4, 2, 16), "vocab_size": 512, "sliding_window": 8,
                    "query_pre_attn_scalar": 16, "layer_types": _every_sixth(6)},
}


def shape_config(shape: str, overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig of a named shape, with `overrides` (HF config keys) applied; layer_types follow
    num_hidden_layers when it is overridden."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    data = json.loads(json.dumps(SHAPES[shape]))
    overrides = dict(overrides or {})
    data.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" in data and "layer_types" not in overrides:
        layers = int(data["num_hidden_layers"])
        data["layer_types"] = (_alternating(layers) if data["model_type"] == "gemma2" else _every_sixth(layers))
    return ModelConfig.from_hf_dict(data, where=f"shape {shape}")


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def random_bf16_bits(rng: np.random.Generator, out: np.ndarray, block: int = 1 << 22) -> None:
    """Fill the uint16 array `out` with bf16 patterns: random sign and mantissa, exponent 2^-7 or 2^-6."""
    flat = out.reshape(-1)
    for start in range(0, flat.size, block):
        part = flat[start:start + block]
        part[...] = np.frombuffer(rng.bytes(part.size * 2), dtype=np.uint16)
        exponent = (part >> 7) & 1  # one random bit picks the exponent
        part &= 0x807F  # keep sign and mantissa
        part |= (exponent + 120) << 7


def random_tensor(name: str, shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    bits = np.empty(shape, dtype=np.uint16)
    random_bf16_bits(rng, bits)
    if np.dtype(dtype) == _bf16():
        return bits.view(_bf16())
    if np.dtype(dtype) == np.float32:
        wide = np.empty(shape, dtype=np.uint32)
        np.left_shift(bits, 16, out=wide, dtype=np.uint32)
        return wide.view(np.float32)
    return bits.view(_bf16()).astype(dtype)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def pending_tensors(config: ModelConfig, dtype: np.dtype, seed: int) -> list[PendingTensor]:
    """Every HF tensor of `config`, in transformers' order, produced lazily."""
    model = abstract_model(config)
    from flax import nnx

    shapes = {path: tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(model))}
    tensors = []
    for entry in tensor_table(config):
        shape = hf_shape(entry.layout, shapes[entry.path])
        tensors.append(PendingTensor(entry.hf_name, shape, dtype,
                                     lambda n=entry.hf_name, s=shape: random_tensor(n, s, dtype, seed)))
    return tensors


def make_checkpoint(shape: str, out_dir: str, *, dtype: str = "bfloat16", seed: int = 0,
                    max_shard_size: str = "5GB", overrides: dict | None = None) -> dict:
    """Write the checkpoint atomically; return a summary (bytes, parameters, files, seconds)."""
    config = shape_config(shape, overrides)
    np_dtype = _bf16() if dtype in ("bfloat16", "bf16") else np.dtype(dtype)
    torch_name = "bfloat16" if np_dtype == _bf16() else str(np_dtype)
    start = time.perf_counter()
    tensors = pending_tensors(config, np_dtype, seed)
    with atomic_folder(out_dir) as tmp:
        files = write_model_files(tmp, tensors, max_shard_size)
        write_json(os.path.join(tmp, "config.json"), config.to_hf_dict(dtype=torch_name))
    total = sum(t.nbytes for t in tensors)
    return {"bench": "make_checkpoint", "shape": shape, "dir": os.path.abspath(out_dir), "dtype": torch_name,
            "parameters": sum(int(np.prod(t.shape)) for t in tensors), "bytes": total, "files": len(files),
            "seconds": round(time.perf_counter() - start, 3)}


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def ensure_checkpoint(shape: str, out_dir: str, **kwargs) -> str:
    """Reuse `out_dir` when it already holds this shape's config (config.json written last, atomically)."""
    config_path = os.path.join(out_dir, "config.json")
    if os.path.exists(config_path):
        want = shape_config(shape, kwargs.get("overrides"))
        if ModelConfig.from_file(out_dir) == want:
            return out_dir
    print(json.dumps(make_checkpoint(shape, out_dir, **kwargs)), file=sys.stderr, flush=True)
    return out_dir


# ------------------------------------------------------------------------------------------------ file layouts
ITEM_SIZES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def layout_header(tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str],
                  layout: str) -> tuple[bytes, list]:
    """The 8-byte length plus header for `(name, dtype code, shape, nbytes)` tensors, and the tensors in file order.

    "hub": as the safetensors library writes it (so transformers and the Hub): sorted by item size, largest
    first, then name; compact JSON padded with spaces to a multiple of 8. "aligned": as our writer does: the
    given order, padded so that the data starts 64-byte aligned."""
    ordered = sorted(tensors, key=lambda t: (-ITEM_SIZES[t[1]], t[0])) if layout == "hub" else list(tensors)
    header, offset = {"__metadata__": metadata}, 0
    for name, code, shape, nbytes in ordered:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * ((-len(blob) % 8) if layout == "hub" else (-(8 + len(blob)) % 64))
    return struct.pack("<Q", len(blob)) + blob, ordered


def data_start(path: str) -> int:
    """Where tensor data starts in a safetensors file (8 + header length)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def rewrite_file(src: str, dst: str, layout: str) -> int:
    """Write the safetensors file `src` again in `layout` ("hub" or "aligned", see layout_header), copying the
    tensor bytes in the kernel. A "hub" file gets a metadata entry when its plain header would happen to put the
    data 64-byte aligned (1 time in 8), so that it is the case 7 Hub files in 8 are in. Returns the data start."""
    with open(src, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    tensors = [(k, v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
               for k, v in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0])]
    metadata = dict(header.get("__metadata__") or {"format": "pt"})
    blob, ordered = layout_header(tensors, metadata, layout)
    while layout == "hub" and len(blob) % 64 == 0:
        metadata["layout"] = metadata.get("layout", "") + "x"
        blob, ordered = layout_header(tensors, metadata, layout)
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fout, blob)  # unbuffered, so that the copies below land after it
        for name, _, _, nbytes in ordered:
            position, done = 8 + length + entries[name]["data_offsets"][0], 0
            while done < nbytes:
                count = os.copy_file_range(fin, fout, nbytes - done, position + done)
                if count <= 0:
                    raise OSError(f"{src}: short copy of tensor {name}")
                done += count
    finally:
        os.close(fin)
        os.close(fout)
    return len(blob)


def copy_with_layout(src_dir: str, out_dir: str, layout: str) -> dict:
    """`src_dir`'s checkpoint with every safetensors file rewritten in `layout`, into `out_dir` atomically (which
    may be `src_dir` itself); the index, config and other files are copied as they are."""
    import shutil

    start = time.perf_counter()
    starts = {}
    with atomic_folder(out_dir) as tmp:
        for name in sorted(os.listdir(src_dir)):
            path = os.path.join(src_dir, name)
            if name.endswith(".safetensors"):
                starts[name] = rewrite_file(path, os.path.join(tmp, name), layout)
            elif os.path.isfile(path) and name != "config.json":
                shutil.copyfile(path, os.path.join(tmp, name))
        shutil.copyfile(os.path.join(src_dir, "config.json"), os.path.join(tmp, "config.json"))  # last: complete
    return {"bench": "make_checkpoint", "layout": layout, "dir": os.path.abspath(out_dir), "source": src_dir,
            "data_start_mod_64": {k: v % 64 for k, v in starts.items()},
            "seconds": round(time.perf_counter() - start, 3)}


def layout_of(folder: str) -> str:
    """"aligned" when every safetensors file's data starts 64-byte aligned (as our writer makes it), else "hub"."""
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return "aligned" if all(data_start(os.path.join(folder, f)) % 64 == 0 for f in files) else "hub"


def ensure_layout(src_dir: str, out_dir: str, layout: str) -> str:
    """`out_dir` holding `src_dir`'s tensors in `layout`: reused when it already does (same config, newer, same
    data sizes), else written (`out_dir` may be `src_dir`: then its files are rewritten in place, atomically)."""
    def payload(folder, name):
        return os.path.getsize(os.path.join(folder, name)) - data_start(os.path.join(folder, name))

    names = [f for f in os.listdir(src_dir) if f.endswith(".safetensors")]
    same = (os.path.exists(os.path.join(out_dir, "config.json"))
            and os.path.getmtime(os.path.join(out_dir, "config.json"))
            >= os.path.getmtime(os.path.join(src_dir, "config.json"))
            and ModelConfig.from_file(out_dir) == ModelConfig.from_file(src_dir) and layout_of(out_dir) == layout
            and all(os.path.exists(os.path.join(out_dir, f)) and payload(out_dir, f) == payload(src_dir, f)
                    for f in names))
    if not same:
        print(json.dumps(copy_with_layout(src_dir, out_dir, layout)), file=sys.stderr, flush=True)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("--hub-copy-of", "--aligned-copy-of"):
        if len(argv) != 3:
            raise SystemExit(f"usage: make_checkpoint.py {argv[0]} SRC_DIR OUT_DIR (OUT_DIR may be SRC_DIR)")
        print(json.dumps(copy_with_layout(argv[1], argv[2], "hub" if argv[0] == "--hub-copy-of" else "aligned")))
        return
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config.json field, e.g. --set num_hidden_layers=2")
    args = parser.parse_args(argv)
    summary = make_checkpoint(args.shape, args.out, dtype=args.dtype, seed=args.seed,
                              max_shard_size=args.max_shard_size, overrides=parse_overrides(args.set))
    import resource

    summary["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
