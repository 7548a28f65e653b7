"""Streaming safetensors reading and writing, and atomic publication of model folders.

Reads go through `safe_open(..., backend="pread")` and `get_slice`, so only the bytes asked for are resident
(`load_file` holds the whole file, and more while converting). Writes lay out the header
first, then append one tensor at a time: a checkpoint is never held twice in memory. A folder is written under a
temporary name beside its destination and renamed into place at the end, so a crash never leaves a folder that
looks complete.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; needed before reading BF16 with framework="numpy")
import numpy as np
from safetensors import SafetensorError, safe_open

from nnx_surgery.surgery.families.errors import CheckpointError
from .atomic import atomic_folder, write_json  # noqa: F401  (re-exported: writers import them from here)
from .host_buffers import ALIGN, aligned_copy, aligned_empty
from .pipeline import work_ahead

DTYPE_CODES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
             "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header


def dtype_code(dtype) -> str:
    try:
        return CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored; use float32, bfloat16 or float16.") from None


# ------------------------------------------------------------------------------------------------ paths
def check_relative_name(name: str, where: str, folder: str = "its folder") -> None:
    """CheckpointError naming the entry unless `name` is a plain relative file name (no `..`, not absolute)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where}: file name {name!r} is not a usable file name.")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith("\\") or ".." in parts or ":" in parts[0]:
        raise CheckpointError(f"{where}: file name {name!r} leads outside {folder}; a checkpoint may only name "
                              "files inside its own folder.")


def confined_path(folder: str, name: str, where: str) -> str:
    """`folder/name` for a file name read from untrusted metadata (an index, a plan, a Hub listing), or a
    CheckpointError naming the entry (`where`) when it would lead outside `folder`: an absolute path, a `..`
    segment, or a symlink (at any level) resolving outside. A Hugging Face cache snapshot links its files to
    `../../blobs/`; those links stay inside the cached repo and are allowed."""
    check_relative_name(name, where, folder)
    path = os.path.join(folder, name)
    resolved, roots = os.path.realpath(path), [os.path.realpath(folder)]
    snapshot = os.path.abspath(folder)
    if os.path.basename(os.path.dirname(snapshot)) == "snapshots":  # <cache>/models--a--b/snapshots/<rev>
        roots.append(os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(snapshot)), "blobs")))
    if not any(resolved == root or resolved.startswith(root + os.sep) for root in roots):
        raise CheckpointError(f"{where}: {name!r} is a link to {resolved}, outside the folder {folder}; a "
                              "checkpoint may only name files inside its own folder.")
    return path


# ------------------------------------------------------------------------------------------------ reading
def checkpoint_weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file name, for a single-file or an index-sharded checkpoint. Every file name
    is confined to `folder` (see `confined_path`)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of tensor name -> file name")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err!r}).") from None
        for tensor, name in sorted(weight_map.items(), key=lambda item: item[1]):
            path = confined_path(folder, name, f"{index}: weight_map entry {tensor!r}")
            if not os.path.exists(path):
                raise CheckpointError(f"{index} names {name}, which is not in {folder}.")
        return dict(weight_map)
    confined_path(folder, SINGLE_FILE, f"{folder}")
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.exists(single):
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; only safetensors checkpoints are read "
                              "(convert .bin files with transformers first).")
    with open_safetensors(single) as f:
        return {name: SINGLE_FILE for name in f.keys()}


@contextlib.contextmanager
def open_safetensors(path: str):
    """Open a safetensors file for row-range reads, turning a corrupt or truncated file into a CheckpointError.

    `safe_open(..., backend="pread")` validates the header; reads then go through `SafetensorsFile`, because
    safetensors 0.8's pread `get_slice(...)[rows]` reads the *whole tensor* for any slice (so a surgery that
    keeps some rows of each matrix reads every matrix many times over; figures in bench/NOTES.md), while rows
    [a, b) of a row-major tensor are one contiguous byte range."""
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror}).") from None
    try:
        with open(path, "rb") as raw:
            header_len = struct.unpack("<Q", raw.read(8))[0] if size >= 8 else None
        if header_len is None or 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated or not a safetensors file (size {size} bytes"
                                  + (f", header length {header_len}" if header_len is not None else "") + ").")
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {header_len} bytes exceeds the safetensors limit of "
                                  f"{MAX_HEADER_BYTES}; the file is corrupt or not a safetensors file.")
        with safe_open(path, framework="numpy", backend="pread"):
            pass
    except (SafetensorError, OSError, struct.error) as err:
        raise CheckpointError(f"{path}: cannot be opened as safetensors ({err}); the file is corrupt or truncated, "
                              "download or write it again.") from None
    header = _check_extent(path, size)
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # reads go mostly forward: a larger kernel read-ahead for cold files
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    try:
        yield SafetensorsFile(path, fd, header, 8 + header_len)
    finally:
        os.close(fd)


def _check_extent(path: str, size: int) -> dict:
    """safe_open checks the header but not that the file holds all the bytes it announces (pread mode)."""
    try:
        with open(path, "rb") as raw:
            header_len = struct.unpack("<Q", raw.read(8))[0]
            header = json.loads(raw.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{path}: corrupt safetensors header ({err!r}).") from None
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: truncated: its header needs {8 + header_len + end} bytes but the file has "
                              f"{size}; download or write it again.")
    return header


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python's mmap names it from 3.12


class SafetensorsFile:
    """The part of safe_open's interface this package uses (`keys`, `metadata`, `get_slice`, `get_tensor`), with
    slices that read only the rows they need, into 64-byte-aligned buffers."""

    def __init__(self, path: str, fd: int, header: dict, data_start: int):
        self.path, self.fd, self.data_start = path, fd, data_start
        self.header = {k: v for k, v in header.items() if k != "__metadata__"}
        self._metadata = header.get("__metadata__")
        self._mapping: mmap.mmap | None = None

    def mapping(self) -> mmap.mmap:
        """The whole file mapped copy-on-write (MAP_PRIVATE): arrays viewing it never change the file, and the
        mapping outlives this handle for as long as an array views it."""
        if self._mapping is None:
            self._mapping = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
        return self._mapping

    def keys(self) -> list[str]:
        return list(self.header)

    def metadata(self) -> dict | None:
        return self._metadata

    def get_slice(self, name: str) -> "RowSlice":
        if name not in self.header:
            raise CheckpointError(f"{self.path}: no tensor {name} in this file.")
        return RowSlice(self, name, self.header[name])

    def get_tensor(self, name: str) -> np.ndarray:
        return self.get_slice(name)[...]


class RowSlice:
    """`get_slice`-like view of one tensor: `view[a:b, c:d]` reads rows [a, b) with one `preadv`, then slices."""

    def __init__(self, file: SafetensorsFile, name: str, entry: dict):
        self.file, self.name = file, name
        self.code, self.shape = entry["dtype"], tuple(entry["shape"])
        self.dtype = np.dtype(DTYPE_CODES[self.code]) if self.code in DTYPE_CODES else None
        self.offset = file.data_start + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.code

    def stored_dtype(self) -> np.dtype:
        """The tensor's dtype; a CheckpointError for a dtype this package does not read."""
        if self.dtype is None:
            raise CheckpointError(f"{self.file.path}: tensor {self.name} has dtype {self.code}; expected F32, BF16 "
                                  "or F16.")
        return self.dtype

    def read_rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) in the stored dtype: into `out` (C-contiguous, that shape and dtype) when given,
        else into a fresh 64-byte-aligned buffer."""
        dtype = self.stored_dtype()
        rows = max(0, stop - start)
        if out is None:
            out = aligned_empty((rows,) + self.shape[1:], dtype)
        elif out.shape != (rows,) + self.shape[1:] or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: read_rows({start}, {stop}) needs a C-contiguous {self.dtype} buffer of "
                             f"shape {(rows,) + self.shape[1:]}, got {out.dtype} {out.shape}.")
        view, done = out.reshape(-1).view(np.uint8).data, 0
        position = self.offset + start * self.row_bytes()
        while done < len(view):
            count = os.preadv(self.file.fd, [view[done:]], position + done)
            if count <= 0:
                raise CheckpointError(f"{self.file.path}: short read of tensor {self.name}; the file is truncated.")
            done += count
        return out

    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.stored_dtype().itemsize

    def mapped_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a view of the file's copy-on-write mapping: nothing is read until `populate`."""
        dtype = self.stored_dtype()
        count = (stop - start) * self.row_bytes() // dtype.itemsize
        view = np.frombuffer(self.file.mapping(), dtype, count, self.mapped_address_offset(start))
        return view.reshape((stop - start,) + self.shape[1:])

    def mapped_address_offset(self, start: int) -> int:
        """Where row `start` lies in the file: a mapped view of it is aligned to ALIGN when this is."""
        return self.offset + start * self.row_bytes()

    def populate(self, start: int, stop: int) -> None:
        """Make the mapped rows [start, stop) resident (read from disk when they are not cached), in one system
        call where the kernel has MADV_POPULATE_READ (Linux 5.14), else by touching every page."""
        lo, hi = self.offset + start * self.row_bytes(), self.offset + stop * self.row_bytes()
        if hi <= lo:
            return
        lo_page = lo - lo % mmap.PAGESIZE
        try:
            self.file.mapping().madvise(MADV_POPULATE_READ, lo_page, hi - lo_page)
        except (AttributeError, OSError, ValueError):
            pages = np.frombuffer(self.file.mapping(), np.uint8, hi - lo_page, lo_page)[::mmap.PAGESIZE]
            int(pages.max())

    def __getitem__(self, index) -> np.ndarray:
        if not self.shape:
            return self.read_rows(0, 1).reshape(())
        if index is Ellipsis:
            index = ()
        index = index if isinstance(index, tuple) else (index,)
        if any(not isinstance(part, slice) for part in index) or len(index) > len(self.shape):
            raise TypeError(f"{self.name}: only slices (one per dimension at most) are supported, got {index!r}.")
        index = index + (slice(None),) * (len(self.shape) - len(index))
        start, stop, step = index[0].indices(self.shape[0])
        if step != 1:
            raise TypeError(f"{self.name}: row slices must have step 1.")
        rows = self.read_rows(start, stop)
        rest = index[1:]
        if all(part == slice(None) for part in rest):
            return rows
        return aligned_copy(rows[(slice(None),) + rest])  # aligned, so that XLA:CPU can adopt it too


# ------------------------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: name, shape and dtype up front; `produce()` makes its numpy data when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, scale in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                        ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def shard_groups(tensors: list[PendingTensor], max_shard_size: int | str) -> list[list[PendingTensor]]:
    """Split tensors, in order, into files of at most `max_shard_size` bytes (a larger tensor gets its own)."""
    limit, groups, current, current_bytes = parse_size(max_shard_size), [], [], 0
    for tensor in tensors:
        if current and current_bytes + tensor.nbytes > limit:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += tensor.nbytes
    if current or not groups:
        groups.append(current)
    return groups


def write_safetensors(path: str, tensors: list[PendingTensor], metadata: dict[str, str] | None = None, *,
                      ahead: int = 1) -> None:
    """Header first, then each tensor's bytes. The next `ahead` tensors are produced on `ahead` threads while the
    current one is written (reads, most numpy work and file writes release the GIL), so reading, arithmetic and
    writing overlap; peak memory is `ahead + 1` tensors."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}  # then each tensor's entry
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": dtype_code(tensor.dtype), "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # data starts 64-byte aligned: loads can map it without copying

    def produce(tensor: PendingTensor) -> np.ndarray:
        data = np.ascontiguousarray(tensor.produce(), dtype=tensor.dtype)
        if data.shape != tuple(tensor.shape):
            raise CheckpointError(f"{path}: tensor {tensor.name} came out {data.shape}, expected {tensor.shape}.")
        return data

    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, data in work_ahead(tensors, produce, workers=ahead, depth=ahead):
            f.write(data.reshape(-1).view(np.uint8).data)
            del data


def write_model_files(folder: str, tensors: list[PendingTensor], max_shard_size: int | str, *,
                      ahead: int = 1) -> list[str]:
    """Write `model.safetensors`, or numbered shards plus an index with `metadata.total_size`. `ahead`: tensors
    produced while one is written (see write_safetensors)."""
    groups = shard_groups(tensors, max_shard_size)
    if len(groups) == 1:
        write_safetensors(os.path.join(folder, SINGLE_FILE), groups[0], ahead=ahead)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(folder, name), group, ahead=ahead)
        names.append(name)
        weight_map.update({t.name: name for t in group})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return names


def copy_aux_files(source: str | None, folder: str) -> list[str]:
    """Copy tokenizer and generation config files verbatim from a teacher folder, when present."""
    copied = []
    if source and os.path.isdir(source):
        for name in AUX_FILES:
            src = confined_path(source, name, f"{source}: {name}")  # a link out of the teacher is not copied out
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(folder, name))
                copied.append(name)
    return copied


def iter_groups_by_file(names: Iterable[str], weight_map: dict[str, str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map[name], []).append(name)
    return by_file
