"""Filling parameters from checkpoint tensors without a second host copy.

On CPU, a block in the checkpoint's dtype whose bytes start 64-byte aligned in the file (every tensor of a file
this package wrote, 1 in 8 files from elsewhere) is a view of the file mapped copy-on-write, made resident with
MADV_POPULATE_READ: XLA:CPU adopts it as the device buffer, so loading costs page-table work, not a copy (as
transformers keeps bf16 weights mmap-backed). Copy-on-write means a donated buffer that XLA writes into gets
private pages and the file never changes; the pages are the page cache's, reclaimable and re-read on demand.

Any other block that is a range of whole HF rows (every block on one device, most on a mesh) is read in pieces
of at most PIECE_BYTES, each one `preadv` into its place in a fresh 64-byte-aligned buffer of the model dtype,
which XLA:CPU also adopts uncopied (on other devices, jax copies it over and drops it); both reader threads share
even a 1 GB embedding, and the bytes in flight stay bounded. Large buffers are anonymous mappings that the thread
reading a piece pre-faults first (`surgery.storage.host_buffers`): that is most of the cost of the copy that files from
the safetensors library or the Hub need (their data is 64-byte aligned 1 time in 8). Other blocks (a mesh cutting
the columns) are read whole and sliced. Parameters are handed to jax in order, as soon as their last piece is in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import jax
import numpy as np
from flax import nnx

from .pipeline import work_ahead
from .host_buffers import ALIGN, aligned_copy, host_buffer, prefault
from .safetensors_stream import RowSlice

READ_THREADS = 2  # preadv releases the GIL: two threads keep both cores copying from the page cache (or disk)
PIECE_BYTES = 32 << 20  # rows read by one preadv
PIECES_AHEAD = 8  # pieces in flight beyond the one the main thread waits for
MAP_FILES = True  # on CPU, let aligned blocks in the checkpoint's dtype be views of the file's pages


@dataclass(frozen=True)
class LoadJob:
    """One parameter to fill: its checkpoint tensor (a RowSlice), layout, NNX shape, dtype and placement."""

    variable: nnx.Variable
    hf_slice: RowSlice
    layout: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding

    def blocks(self) -> dict[tuple, tuple]:
        """Block key -> NNX index, for the distinct blocks this process's devices hold."""
        indices = self.sharding.addressable_devices_indices_map(self.shape).values()
        if any(index is None for index in indices):
            raise ValueError(f"{self.sharding} places no block of a {self.shape} parameter on one of its devices.")
        return {block_key(index): index for index in indices if index is not None}


@dataclass(frozen=True)
class _Piece:
    job: int  # position in the job list
    key: tuple  # the block it belongs to
    index: tuple  # NNX index of that block
    target: np.ndarray | None  # the rows of the block's buffer this piece fills; None: read the block whole
    rows: tuple[int, int]  # HF rows [a, b) of this piece
    mapped: bool = False  # the block views the file's mapping: this piece makes its rows resident


def block_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def fill_parameters(jobs: list[LoadJob], read_block) -> None:
    """Set every job's variable to a jax array made from its blocks. `read_block(job, index)` reads a block that
    is not a range of whole rows (an array in the NNX block shape)."""
    buffers: list[dict[tuple, np.ndarray]] = [{} for _ in jobs]
    pending = [0] * len(jobs)
    # Every buffer is created (address space only, nothing touched) before the first read: creating a mapping
    # waits for the address-space lock that the readers' pre-faulting holds, and would stall them by turns.
    pieces = [piece for number, job in enumerate(jobs) for key, index in job.blocks().items()
              for piece in _split(number, job, key, index, buffers[number])]
    for piece in pieces:
        pending[piece.job] += 1

    def read(piece: _Piece):
        job = jobs[piece.job]
        if piece.mapped:
            job.hf_slice.populate(*piece.rows)
            return None
        if piece.target is not None:
            a, b = piece.rows
            prefault(piece.target)
            if job.hf_slice.dtype == piece.target.dtype:
                job.hf_slice.read_rows(a, b, out=piece.target)
            else:
                piece.target[...] = job.hf_slice.read_rows(a, b)
            return None
        return aligned_copy(read_block(job, piece.index), job.dtype)

    for piece, block in work_ahead(pieces, read, workers=READ_THREADS, depth=PIECES_AHEAD):
        if block is not None:
            buffers[piece.job][piece.key] = block
        del block
        pending[piece.job] -= 1
        if pending[piece.job] == 0:
            job, blocks = jobs[piece.job], buffers[piece.job]
            job.variable.set_value(jax.make_array_from_callback(
                job.shape, job.sharding, lambda index, blocks=blocks: blocks[block_key(index)]))
            buffers[piece.job] = {}  # jax holds the buffers now (or has copied them to its device)


def _split(number: int, job: LoadJob, key: tuple, index: tuple, buffers: dict) -> Iterator[_Piece]:
    """The pieces of one block: row ranges into a fresh aligned buffer, or one piece that reads it whole."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, job.shape)]
    rows = _hf_rows(job.layout, job.shape, bounds)
    block_shape = tuple(b - a for a, b in bounds)
    if rows is None:
        yield _Piece(number, key, index, None, (0, 0))
        return
    row_bytes = max(1, job.hf_slice.row_bytes())
    step = max(1, PIECE_BYTES // row_bytes)
    if _can_map(job, rows[0]):
        buffers[key] = job.hf_slice.mapped_rows(*rows).reshape(block_shape)
        for a in range(rows[0], rows[1], step):
            yield _Piece(number, key, index, None, (a, min(rows[1], a + step)), mapped=True)
        return
    buffer = host_buffer(block_shape, job.dtype)
    buffers[key] = buffer
    hf_rows = buffer.reshape((rows[1] - rows[0],) + tuple(job.hf_slice.shape[1:]))
    for a in range(rows[0], rows[1], step):
        b = min(rows[1], a + step)
        yield _Piece(number, key, index, hf_rows[a - rows[0]:b - rows[0]], (a, b))


def _can_map(job: LoadJob, first_row: int) -> bool:
    """Whether the block can be the file's own pages: a CPU device (XLA:CPU adopts the view as its buffer), the
    checkpoint's dtype, and a 64-byte-aligned start (mappings are page-aligned, so the file offset decides)."""
    return (MAP_FILES and job.hf_slice.dtype == job.dtype
            and job.hf_slice.mapped_address_offset(first_row) % ALIGN == 0
            and all(device.platform == "cpu" for device in _devices(job.sharding)))


def _devices(sharding: jax.sharding.Sharding) -> Iterable[Any]:
    """The sharding's devices (jax.Device is an alias of a compiled class, which a type checker cannot see)."""
    return sharding.device_set


def _hf_rows(layout: str, shape: tuple[int, ...], bounds: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The HF rows [a, b) a block is made of, when it is a range of whole rows; else None."""
    full = [bounds[i] == (0, shape[i]) for i in range(len(shape))]
    if not shape or any(b <= a for a, b in bounds):
        return None
    if layout in ("split_rows", "flat"):  # (N, H, D) from [N*H, D] or (N, H) from [N*H]: whole heads
        (n0, n1) = bounds[0]
        return (n0 * shape[1], n1 * shape[1]) if all(full[1:]) else None
    return bounds[0] if all(full[1:]) else None  # same, split_cols (D, N, H): HF rows are NNX axis 0
