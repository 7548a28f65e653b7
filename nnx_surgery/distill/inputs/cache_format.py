"""How the teacher cache stores a token's top-k distribution (`distill.inputs.topk_cache`), and its shard files.

Per token the cache holds the teacher's k most likely ids with their log-probabilities at temperature 1 (sorted,
most likely first) and the residual: the log of the probability mass outside the top k. An encoding says how:

    exact    ids int32, log-probabilities float32, residual float32: the computed values bit for bit
    float16  ids bit-packed, log-probabilities and residual float16
    q16      ids bit-packed, the top-1 log-probability float32, the other k - 1 as uint16 steps below it on a
             square-root scale, residual float16
    q8       as q16 with uint8 steps

Bit-packed ids take ceil(log2 V) bits each (18 for Gemma's 262,144 pieces), a token's k ids rounded up to whole
bytes. The q encodings store d_i = lp_1 - lp_i >= 0 as round(sqrt(d_i / D) * Q) (Q = 255 or 65535, D =
32 nats for q8, 64 for q16; larger d clamped): the step grows with d, so the error is smallest on the likely tokens,
where the distribution's mass (and a KL's sensitivity) is. bench/teacher_cache_encoding.py measures bytes and
errors of each.

A shard is a safetensors file (no pickle): the encoded arrays of `rows` consecutive packed rows plus `input_ids`
and `flags` (per token: bit 0-1 the packing's kind, 2 a document's first token, 1 another, 0 padding; bit 2 the
token is a trainable target), written atomically (`atomic_bytes`) with its sha256 in the manifest. Reading maps
the file (`ShardReader`), so a shuffled batch reads only its rows.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from typing import Iterator

import numpy as np

ENCODINGS = ("exact", "float16", "q16", "q8")
# per q encoding: (levels, stored dtype, DELTA_RANGE: the nats below the top-1 log-probability it resolves)
_LEVELS = {"q16": (65535, np.uint16, 64.0), "q8": (255, np.uint8, 32.0)}


class CacheError(ValueError):
    """A teacher cache that cannot be written or read as asked: the message names the file or setting."""


def id_bits(vocab_size: int) -> int:
    return max(1, math.ceil(math.log2(max(2, vocab_size))))


def token_dtype(vocab_size: int) -> np.dtype:
    """The rows' own token ids: uint16 when the vocabulary fits, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def pack_ids(ids: np.ndarray, bits: int) -> np.ndarray:
    """(..., k) ids < 2**bits -> (..., ceil(k * bits / 8)) uint8, little-endian bit order."""
    shifts = np.arange(bits, dtype=np.uint32)
    flat = ((ids.astype(np.uint32)[..., None] >> shifts) & 1).astype(np.uint8)
    flat = flat.reshape(*ids.shape[:-1], ids.shape[-1] * bits)
    return np.packbits(flat, axis=-1, bitorder="little")


def unpack_ids(packed: np.ndarray, bits: int, k: int) -> np.ndarray:
    flat = np.unpackbits(packed, axis=-1, bitorder="little")[..., :k * bits]
    flat = flat.reshape(*packed.shape[:-1], k, bits).astype(np.int32)
    return (flat << np.arange(bits, dtype=np.int32)).sum(-1, dtype=np.int32)


def encode(ids: np.ndarray, logprobs: np.ndarray, residual: np.ndarray, encoding: str,
           vocab_size: int) -> dict[str, np.ndarray]:
    """The stored arrays of (..., k) top-k ids and log-probabilities (sorted, descending) and (...) residuals."""
    if encoding == "exact":
        return {"topk_ids": ids.astype(np.int32), "topk_logprobs": logprobs.astype(np.float32),
                "residual": residual.astype(np.float32)}
    out = {"topk_ids_packed": pack_ids(ids, id_bits(vocab_size)), "residual": residual.astype(np.float16)}
    if encoding == "float16":
        out["topk_logprobs"] = logprobs.astype(np.float16)
        return out
    levels, dtype, span = _LEVELS[encoding]
    top1 = logprobs[..., :1].astype(np.float32)
    delta = np.clip((top1 - logprobs[..., 1:]) / span, 0.0, 1.0)
    out["top1"] = top1[..., 0]
    out["deltas"] = np.round(np.sqrt(delta) * levels).astype(dtype)
    return out


def decode(arrays: dict[str, np.ndarray], encoding: str, vocab_size: int, k: int) -> dict[str, np.ndarray]:
    """`encode`'s inverse: {"topk_ids" int32, "topk_logprobs" float32, "residual" float32} of (..., k) / (...)."""
    if encoding == "exact":
        return {"topk_ids": np.asarray(arrays["topk_ids"], np.int32),
                "topk_logprobs": np.asarray(arrays["topk_logprobs"], np.float32),
                "residual": np.asarray(arrays["residual"], np.float32)}
    out = {"topk_ids": unpack_ids(np.asarray(arrays["topk_ids_packed"]), id_bits(vocab_size), k),
           "residual": np.asarray(arrays["residual"], np.float32)}
    if encoding == "float16":
        out["topk_logprobs"] = np.asarray(arrays["topk_logprobs"], np.float32)
        return out
    levels, _, span = _LEVELS[encoding]
    top1 = np.asarray(arrays["top1"], np.float32)[..., None]
    steps = np.asarray(arrays["deltas"], np.float32) / levels
    out["topk_logprobs"] = np.concatenate([top1, top1 - steps * steps * span], axis=-1)
    return out


def bytes_per_token(encoding: str, k: int, vocab_size: int) -> int:
    """What one token's top-k takes in a shard (without its own id and flags, which every encoding stores)."""
    ids = np.zeros((1, k), np.int64)
    stored = encode(ids, np.zeros((1, k), np.float32), np.zeros(1, np.float32), encoding, vocab_size)
    return sum(array.nbytes for array in stored.values())


# ------------------------------------------------------------------------------------------------ files
def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _temporary_beside(path: str) -> Iterator[str]:
    parent, base = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.partial-{os.getpid()}-", dir=parent)
    os.close(fd)
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def atomic_bytes(path: str, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, rename it onto `path`: a full disk or a kill
    leaves either the old file or none, never a partial one under the final name (`surgery.storage.atomic` does the
    same for the surgery's files; distill does not import it)."""
    with _temporary_beside(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


def atomic_json(path: str, value) -> None:
    atomic_bytes(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


class ShardReader:
    """The tensors of one safetensors shard as read-only memory maps (the format: an 8-byte little-endian
    header length, a JSON header of dtype, shape and byte offsets, then the data)."""

    _DTYPES = {"U8": np.uint8, "U16": np.uint16, "I32": np.int32, "F16": np.float16, "F32": np.float32}

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length))
            raw = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as error:
            raise CacheError(f"{path}: not a readable shard ({error}); write the cache again with --resume.") from None
        header.pop("__metadata__", None)
        self.arrays = {}
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            view = raw[8 + length + start: 8 + length + end]
            self.arrays[name] = view.view(self._DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.asarray(array[index]) for name, array in self.arrays.items()}


__all__ = ["ENCODINGS", "CacheError", "id_bits", "token_dtype", "pack_ids", "unpack_ids", "encode",
           "decode", "bytes_per_token", "sha256_file", "atomic_bytes", "atomic_json", "ShardReader"]
