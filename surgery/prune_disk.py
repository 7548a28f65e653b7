"""`prune_checkpoint`: the surgery from an HF checkpoint on disk straight to a student HF folder.

Teacher tensors are never materialised: each student tensor is produced only when the writer reaches it, from
`preadv` reads of the kept rows (contiguous runs), the kept columns gathered while copying into the output, a
block of rows at a time; two threads build the next two tensors while the writer writes the current one (one
gathers columns while the other waits on the disk). Peak host memory is about three student tensors plus a block
per thread, so a 7B-shaped teacher (17 GB of bf16) becomes a 2B-shaped student on a machine with far less memory
than the teacher (1.2 GiB peak RSS for 7B -> 2B).

The result equals `save_student(apply_plan(load_pretrained(src), plan), plan, dst)` bit for bit: same recipes,
same host arithmetic, same writer.
"""
from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from .checkpoint import (DTYPES, canonical_names, checkpoint_dtype, hf_shape, resolve_source, tensor_table,
                         write_hf_folder)
from .config import GemmaConfig
from .plan import Plan
from .safetensors_io import CheckpointError, PendingTensor, checkpoint_weight_map, open_safetensors
from .slices import Reader, build, nnx_shape, recipes

DEFAULT_CHUNK_BYTES = 16 << 20
PRODUCE_AHEAD = 2  # student tensors built at once while one is written: one thread gathers while another reads


GAP_ROWS = 8  # read through gaps of up to this many rows rather than issuing another read


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


def disk_reader(folder: str, dtype, stack: contextlib.ExitStack | None = None,
                config: GemmaConfig | None = None) -> Reader:
    """`read(hf_name, rows, cols, out=None)` from a checkpoint folder, in HF layout, cast to `dtype`.

    Kept rows are read run by run with `preadv` (whole runs straight into `out` when no column is dropped and
    the dtype is kept) and kept columns are gathered while copying each run into the result: one pass over the
    bytes read. Files are opened on first use and kept open in `stack` when given (closed with it), else reopened
    per read. With `config`, every tensor's stored shape is checked against it."""
    weight_map = checkpoint_weight_map(folder)
    names, _ = canonical_names(weight_map)
    expected = {e.hf_name: hf_shape(e.layout, nnx_shape(config, e.path)) for e in tensor_table(config)} \
        if config is not None else {}
    handles: dict[str, object] = {}
    dtype = np.dtype(dtype)

    @contextlib.contextmanager
    def handle(file_name):
        if stack is None:
            with open_safetensors(os.path.join(folder, file_name)) as f:
                yield f
            return
        if file_name not in handles:
            handles[file_name] = stack.enter_context(open_safetensors(os.path.join(folder, file_name)))
        yield handles[file_name]

    def file_of(name):
        if name not in names:
            raise CheckpointError(f"{folder}: checkpoint has no tensor {name}; the files do not match config.json.")
        return weight_map[names[name]]

    def tensor(f, name):
        hf_slice = f.get_slice(names[name])
        shape = tuple(hf_slice.get_shape())
        if name in expected and shape != expected[name]:
            raise CheckpointError(f"{folder}: tensor {names[name]} has shape {list(shape)}, config.json implies "
                                  f"{list(expected[name])}.")
        return hf_slice, shape

    def read(name, rows, cols, out=None):
        with handle(file_of(name)) as f:
            hf_slice, shape = tensor(f, name)
            cols = None if cols is None or len(shape) == 1 else np.asarray(cols, dtype=np.int64)
            runs = row_runs(rows, shape[0])
            result_shape = (sum(hi - lo if picked is None else len(picked) for lo, hi, picked in runs),) + \
                ((shape[1] if cols is None else len(cols),) if len(shape) == 2 else ())
            if out is None:
                out = np.empty(result_shape, dtype)
            elif out.shape != result_shape or not out.flags.c_contiguous:
                raise ValueError(f"{name}: out has shape {out.shape}, the read gives {result_shape}.")
            position = 0
            for lo, hi, picked in runs:
                count = hi - lo if picked is None else len(picked)
                _copy_run(hf_slice, lo, hi, picked, cols, out[position:position + count])
                position += count
            return out

    return read


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
        span = np.take(span, picked, axis=0)  # whole rows: 2x faster than one np.ix_ gather of rows and columns
    if cols is not None:
        if target.dtype == span.dtype:
            np.take(span, cols, axis=1, out=target)
            return
        span = np.take(span, cols, axis=1)
    target[...] = span


def prune_checkpoint(src: str | os.PathLike, plan: Plan, dst: str | os.PathLike, *, dtype=None,
                     revision: str | None = None, max_shard_size: int | str = "5GB",
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, report: bool = True, overwrite: bool = False) -> str:
    """Write the student `plan` describes, cut from the HF checkpoint `src`, as an HF folder `dst`.

    `dtype` defaults to the checkpoint's (as `load_pretrained`). `chunk_bytes` bounds the float32 block a recipe
    works on. `plan.json` (and, with `report`, the report as text and PNG) is written into `dst`; an existing
    non-empty `dst` is refused unless `overwrite=True`."""
    from .apply import student_files

    folder = resolve_source(src, revision)
    config = GemmaConfig.from_file(folder)
    plan.check_teacher(config, where=f"checkpoint {folder}", read=disk_reader(folder, np.float32, None, config))
    plan.validate()
    weight_map = checkpoint_weight_map(folder)
    names, _ = canonical_names(weight_map)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    dtype = np.dtype(dtype or checkpoint_dtype(folder, config, weight_map, names))
    with contextlib.ExitStack() as stack:
        read = disk_reader(folder, dtype, stack, config)
        tensors = [PendingTensor(r.hf_name, r.shape, dtype, functools.partial(build, r, read, dtype, chunk_bytes))
                   for r in recipes(plan)]
        return write_hf_folder(os.fspath(dst), plan.student, tensors, source=folder, max_shard_size=max_shard_size,
                               extra_files=student_files(plan, report), produce_ahead=PRODUCE_AHEAD,
                               overwrite=overwrite)
