"""How the teacher cache stores a token's top-k distribution (`distill.inputs.topk_cache`), and its shard files.

Per token the cache holds the teacher's k most likely ids with their log-probabilities at temperature 1 (sorted,
most likely first) and the residual: the log of the probability mass outside the top k. An encoding says how:

    exact    ids int32, log-probabilities float32, residual float32: the computed values bit for bit
    float16  ids bit-packed, log-probabilities and residual float16
    q16      ids bit-packed, the top-1 log-probability float32, the other k - 1 as uint16 steps below it on a
             square-root scale, residual float16
    q8       as q16 with uint8 steps
    q8z      q8's values and errors in less space: each row's ids in ascending order as gaps (the first id, then
             the differences; a top k clusters, median gap about 50 of Gemma 3's 262k pieces) and their steps in
             that order, LZMA-compressed row by row (the gaps' bytes split into planes first); the reader
             decompresses the rows a batch takes and restores the likely-first order

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
import lzma
import math
import os
import tempfile
from typing import Iterator

import numpy as np

ENCODINGS = ("exact", "float16", "q16", "q8", "q8z")
ROW_BLOB, ROW_OFFSETS = "rows_lzma", "row_offsets"  # q8z: the compressed rows, one after the other, and their starts
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
    if encoding == "q8z":
        return _encode_compressed(ids, logprobs, residual)
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


def _encode_compressed(ids: np.ndarray, logprobs: np.ndarray, residual: np.ndarray) -> dict[str, np.ndarray]:
    """q8z of (R, T, k) arrays (a shard's rows; (N, k) is one row of N tokens): top1 and residual as q8 stores them,
    each row's sorted-id gaps (uint32 in 4 byte planes) and q8 steps in one LZMA stream."""
    if ids.ndim == 2:
        ids, logprobs, residual = ids[None], logprobs[None], residual[None]
    q8 = encode(ids[..., :0], logprobs, residual, "q8", 2)  # top1, residual, deltas (steps of ranks 2..k)
    steps = np.concatenate([np.zeros_like(q8["deltas"][..., :1]), q8["deltas"]], -1)
    order = np.argsort(ids, axis=-1, kind="stable")
    gaps = np.diff(np.take_along_axis(ids.astype(np.int64), order, -1), axis=-1, prepend=0).astype("<u4")
    steps = np.take_along_axis(steps, order, -1)
    blobs = [lzma.compress(np.ascontiguousarray(gaps[r].view(np.uint8).reshape(-1, 4).T).tobytes()
                           + steps[r].tobytes()) for r in range(len(ids))]
    offsets = np.cumsum([0] + [len(blob) for blob in blobs], dtype=np.int64)
    return {ROW_BLOB: np.frombuffer(b"".join(blobs), np.uint8), ROW_OFFSETS: offsets, "top1": q8["top1"],
            "residual": q8["residual"]}


def decompress_rows(blob: np.ndarray, offsets: np.ndarray, index: np.ndarray, tokens: int
                    ) -> dict[str, np.ndarray]:
    """q8z's rows `index` (of a shard's `blob` and `offsets`, rows of `tokens` tokens): {"sorted_ids" (n, T, k)
    int32, "id_steps" uint8}, the ids ascending and each id's step below the top 1."""
    ids = steps = None
    for out, row in enumerate(np.asarray(index)):
        raw = lzma.decompress(blob[offsets[row]:offsets[row + 1]].tobytes())
        k = len(raw) // (5 * tokens)
        if ids is None:
            ids = np.empty((len(index), tokens, k), np.int32)
            steps = np.empty((len(index), tokens, k), np.uint8)
        planes = np.frombuffer(raw, np.uint8, 4 * tokens * k).reshape(4, tokens * k)
        gaps = np.ascontiguousarray(planes.T).view("<u4").reshape(tokens, k)
        ids[out] = np.cumsum(gaps, axis=-1, dtype=np.int64)
        steps[out] = np.frombuffer(raw, np.uint8, offset=4 * tokens * k).reshape(tokens, k)
    if ids is None or steps is None:  # both made at the first row
        raise CacheError("decompress_rows: no rows asked for.")
    return {"sorted_ids": ids, "id_steps": steps}


def _decode_compressed(arrays: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """q8z's rows back in q8's form: most likely first (by step, then id: a tie of steps keeps id order)."""
    if "sorted_ids" not in arrays:  # encode's output itself (every row)
        top1 = np.asarray(arrays["top1"])
        tokens = top1.shape[-1] if top1.ndim > 1 else top1.shape[0]
        rows = len(arrays[ROW_OFFSETS]) - 1
        arrays = {**arrays, **decompress_rows(np.asarray(arrays[ROW_BLOB]), np.asarray(arrays[ROW_OFFSETS]),
                                              np.arange(rows), tokens)}
        if top1.ndim == 1:  # encoded as one row of N tokens
            arrays["sorted_ids"], arrays["id_steps"] = arrays["sorted_ids"][0], arrays["id_steps"][0]
    order = np.argsort(arrays["id_steps"], axis=-1, kind="stable")
    q8 = {"top1": arrays["top1"], "residual": arrays["residual"],
          "deltas": np.take_along_axis(arrays["id_steps"], order, -1)[..., 1:]}
    out = decode({**q8, "topk_ids_packed": np.zeros((*order.shape[:-1], 0), np.uint8)}, "q8", 2, 0)
    out["topk_ids"] = np.take_along_axis(arrays["sorted_ids"], order, -1)
    return out


def decode(arrays: dict[str, np.ndarray], encoding: str, vocab_size: int, k: int) -> dict[str, np.ndarray]:
    """`encode`'s inverse: {"topk_ids" int32, "topk_logprobs" float32, "residual" float32} of (..., k) / (...)."""
    if encoding == "exact":
        return {"topk_ids": np.asarray(arrays["topk_ids"], np.int32),
                "topk_logprobs": np.asarray(arrays["topk_logprobs"], np.float32),
                "residual": np.asarray(arrays["residual"], np.float32)}
    if encoding == "q8z":
        return _decode_compressed(arrays, k)
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


def bytes_per_token(encoding: str, k: int, vocab_size: int) -> int | None:
    """What one token's top-k takes in a shard (without its own id and flags, which every encoding stores); None
    for q8z, whose size depends on the data (bench/teacher_cache_encoding.py measures it)."""
    if encoding == "q8z":
        return None
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

    _DTYPES = {"U8": np.uint8, "U16": np.uint16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
               "F32": np.float32}

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
        """The arrays of rows `index`; a q8z shard's rows decompressed (`decompress_rows`)."""
        plain = {name: np.asarray(array[index]) for name, array in self.arrays.items()
                 if name not in (ROW_BLOB, ROW_OFFSETS)}
        if ROW_BLOB in self.arrays:
            tokens = self.arrays["top1"].shape[1]
            plain.update(decompress_rows(self.arrays[ROW_BLOB], self.arrays[ROW_OFFSETS], index, tokens))
        return plain


__all__ = ["ENCODINGS", "ROW_BLOB", "ROW_OFFSETS", "CacheError", "decompress_rows", "id_bits", "token_dtype", "pack_ids", "unpack_ids", "encode",
           "decode", "bytes_per_token", "sha256_file", "atomic_bytes", "atomic_json", "ShardReader"]
