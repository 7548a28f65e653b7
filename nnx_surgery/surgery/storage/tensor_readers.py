"""Teacher tensor readers: the one thing the two surgery paths do differently.

A reader answers `read(hf_name, rows, cols, out=None)`: the teacher's tensor `hf_name` in HF layout ([out, in]
matrices, head-major rows for q/k/v, head-major columns for o_proj), restricted to the `rows` and `cols` index
arrays (None = all), in the reader's dtype; written into `out` (a C-contiguous array of the result's shape) when
given, so plain copies land in the output tensor without an intermediate.

- `MemoryReader` reads an NNX model's parameters (`apply_plan`, and planning from a loaded teacher);
- `DiskReader` reads a safetensors checkpoint folder without materialising any tensor (`prune_checkpoint`, and
  data-free planning from a folder).

The slice recipes (`surgery.pruning.tensor_slices`), the magnitude scores (`surgery.planning.importance`) and the plan's teacher
fingerprint (`surgery.plans.plan_record`) take any `Reader`, so they never know where the teacher lives.
"""
from __future__ import annotations

import contextlib
import os
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.surgery.storage.hf_checkpoint import TensorEntry, canonical_names, hf_shape, tensor_table
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import CausalLM, abstract_model
from nnx_surgery.surgery.storage.safetensors_stream import CheckpointError, checkpoint_weight_map, open_safetensors

GAP_ROWS = 8  # read through gaps of up to this many rows rather than issuing another read


@runtime_checkable
class Reader(Protocol):
    """`read(hf_name, rows, cols, out=None)`: a block of a teacher tensor in HF layout (module docstring)."""

    def __call__(self, hf_name: str, rows: np.ndarray | None, cols: np.ndarray | None,
                 out: np.ndarray | None = None) -> np.ndarray: ...


class MemoryReader:
    """A `Reader` over an NNX model's parameters, in the model's dtype. Kept slices are gathered on the model's
    devices (`jnp.take`, exact) and only the block is brought to the host."""

    def __init__(self, model: CausalLM):
        self.state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        self.table = {entry.hf_name: entry for entry in tensor_table(model.config)}
        self.head_dim = model.config.head_dim

    def __call__(self, hf_name: str, rows: np.ndarray | None, cols: np.ndarray | None,
                 out: np.ndarray | None = None) -> np.ndarray:
        block = self._gather(self.table[hf_name], rows, cols)
        if out is None:
            return block
        out[...] = block
        return out

    def _gather(self, entry: TensorEntry, rows, cols) -> np.ndarray:
        array = self.state[entry.path][...]
        if entry.layout == "same":  # HF layout already
            block = _take(_take(array, rows, 0), cols, 1) if array.ndim == 2 else _take(array, rows, 0)
            return np.asarray(jax.device_get(block))
        if entry.layout == "split_rows":  # NNX (N, H, D) = HF [N*H, D]
            block = np.asarray(jax.device_get(_take(_take(array, self._heads(rows), 0), cols, 2)))
            return block.reshape(-1, block.shape[-1])
        if entry.layout == "split_cols":  # NNX (D, N, H) = HF [D, N*H]
            block = np.asarray(jax.device_get(_take(_take(array, rows, 0), self._heads(cols), 1)))
            return block.reshape(block.shape[0], -1)
        if entry.layout == "flat":  # NNX (N, H) = HF [N*H] (per-head biases)
            return np.asarray(jax.device_get(_take(array, self._heads(rows), 0))).reshape(-1)
        raise ValueError(f"{entry.hf_name}: unknown layout {entry.layout!r}")

    def _heads(self, index) -> np.ndarray | None:
        """HF row (column) indices of whole heads -> the head indices of the NNX (heads, head_dim) axes."""
        if index is None:
            return None
        index = np.asarray(index, dtype=np.int64).reshape(-1, self.head_dim)
        heads = index[:, 0] // self.head_dim
        if not np.array_equal(index, heads[:, None] * self.head_dim + np.arange(self.head_dim)):
            raise ValueError("head-structured tensors are read in whole heads")
        return heads


def _take(array, index, axis):
    return array if index is None else jnp.take(array, jnp.asarray(index), axis=axis)


class DiskReader:
    """A `Reader` over a safetensors checkpoint folder, cast to `dtype`.

    Kept rows are read run by run with `preadv` (whole runs straight into `out` when no column is dropped and
    the dtype is kept) and kept columns are gathered while copying each run into the result: one pass over the
    bytes read. Files are opened on first use and kept open in `stack` when given (closed with it), else reopened
    per read. With `config`, every tensor's stored shape is checked against it."""

    def __init__(self, folder: str | os.PathLike, dtype, stack: contextlib.ExitStack | None = None,
                 config: ModelConfig | None = None):
        self.folder = os.fspath(folder)
        self.dtype = np.dtype(dtype)
        self.stack = stack
        self.weight_map = checkpoint_weight_map(self.folder)
        self.names, _ = canonical_names(self.weight_map)  # canonical HF name -> name stored in the files
        self.expected = expected_hf_shapes(config) if config is not None else {}
        self.handles: dict[str, object] = {}

    def __call__(self, hf_name: str, rows: np.ndarray | None, cols: np.ndarray | None,
                 out: np.ndarray | None = None) -> np.ndarray:
        with self._open(self._file_of(hf_name)) as f:
            hf_slice, shape = self._tensor(f, hf_name)
            cols = None if cols is None or len(shape) == 1 else np.asarray(cols, dtype=np.int64)
            runs = row_runs(rows, shape[0])
            result_shape = (sum(hi - lo if picked is None else len(picked) for lo, hi, picked in runs),) + \
                ((shape[1] if cols is None else len(cols),) if len(shape) == 2 else ())
            if out is None:
                out = np.empty(result_shape, self.dtype)
            elif out.shape != result_shape or not out.flags.c_contiguous:
                raise ValueError(f"{hf_name}: out has shape {out.shape}, the read gives {result_shape}.")
            position = 0
            for lo, hi, picked in runs:
                count = hi - lo if picked is None else len(picked)
                _copy_run(hf_slice, lo, hi, picked, cols, out[position:position + count])
                position += count
            return out

    @contextlib.contextmanager
    def _open(self, file_name: str):
        path = os.path.join(self.folder, file_name)
        if self.stack is None:
            with open_safetensors(path) as f:
                yield f
            return
        if file_name not in self.handles:
            self.handles[file_name] = self.stack.enter_context(open_safetensors(path))
        yield self.handles[file_name]

    def _file_of(self, hf_name: str) -> str:
        if hf_name not in self.names:
            raise CheckpointError(f"{self.folder}: checkpoint has no tensor {hf_name}; the files do not match "
                                  "config.json.")
        return self.weight_map[self.names[hf_name]]

    def _tensor(self, f, hf_name: str):
        hf_slice = f.get_slice(self.names[hf_name])
        shape = tuple(hf_slice.get_shape())
        if hf_name in self.expected and shape != self.expected[hf_name]:
            raise CheckpointError(f"{self.folder}: tensor {self.names[hf_name]} has shape {list(shape)}, "
                                  f"config.json implies {list(self.expected[hf_name])}.")
        return hf_slice, shape


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF shape of every tensor `config` implies (from the abstract model: no memory is allocated)."""
    params = dict(nnx.to_flat_state(nnx.state(abstract_model(config), nnx.Param)))
    return {e.hf_name: hf_shape(e.layout, tuple(params[e.path].shape)) for e in tensor_table(config)}


def row_runs(rows: np.ndarray | None, nrows: int) -> list[tuple[int, int, np.ndarray | None]]:
    """Cover `rows` (in their order) with few contiguous reads: `(start, stop, picked)` per run of increasing rows
    with gaps of at most GAP_ROWS, `picked` the rows to keep relative to `start` (None: all of [start, stop))."""
    if rows is None:
        return [(0, nrows, None)]
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return [(0, 0, None)]
    steps = np.diff(rows)
    breaks = np.flatnonzero((steps > GAP_ROWS) | (steps < 1)) + 1
    runs = []
    for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(rows)]])):
        lo, hi = int(rows[a]), int(rows[b - 1]) + 1
        runs.append((lo, hi, None if hi - lo == b - a else rows[a:b] - lo))
    return runs


def _copy_run(hf_slice, lo: int, hi: int, picked: np.ndarray | None, cols: np.ndarray | None,
              target: np.ndarray) -> None:
    """Rows [lo, hi) of a tensor, restricted to `picked` rows and `cols` columns, into `target` (cast to its
    dtype): a straight `preadv` into `target` when nothing is dropped, else one gather pass after the read."""
    if picked is None and cols is None and target.dtype == hf_slice.dtype:
        hf_slice.read_rows(lo, hi, out=target)
        return
    span = hf_slice.read_rows(lo, hi)
    if cols is not None and len(cols) and np.array_equal(cols, np.arange(cols[0], cols[0] + len(cols))):
        span = span[:, cols[0]:cols[0] + len(cols)]  # a contiguous range of columns: a view
        cols = None
    if picked is not None:
        span = np.take(span, picked, axis=0)  # whole rows first: cheaper than one np.ix_ gather of both axes
    if cols is not None:
        if target.dtype == span.dtype:
            np.take(span, cols, axis=1, out=target)
            return
        span = np.take(span, cols, axis=1)
    target[...] = span


__all__ = ["Reader", "MemoryReader", "DiskReader", "row_runs", "expected_hf_shapes", "GAP_ROWS"]
