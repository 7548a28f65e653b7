"""`prune_checkpoint`: the surgery from an HF checkpoint on disk straight to a student HF folder.

Teacher tensors are never materialised: each student tensor is produced only when the writer reaches it, from
`pread` reads of the kept rows (contiguous runs) and the bounding range of kept columns, a block of rows at a
time. Peak host memory is about the student tensor being written plus one block, so a 7B-shaped teacher
(17 GB of bf16) becomes a 2B-shaped student on a machine with far less memory than the teacher.

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
from .slices import Reader, build, nnx_shape, read_runs, recipes

DEFAULT_CHUNK_BYTES = 16 << 20


def disk_reader(folder: str, dtype, stack: contextlib.ExitStack | None = None,
                config: GemmaConfig | None = None) -> Reader:
    """`read(hf_name, rows, cols)` from a checkpoint folder, in HF layout, cast to `dtype`.

    Files are opened on first use (pread backend: no mapping) and kept open in `stack` when given (closed
    with it), else reopened per read. With `config`, every tensor's stored shape is checked against it."""
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

    def read(name, rows, cols):
        if name not in names:
            raise CheckpointError(f"{folder}: checkpoint has no tensor {name}; the files do not match config.json.")
        stored = names[name]
        with handle(weight_map[stored]) as f:
            hf_slice = f.get_slice(stored)
            shape = hf_slice.get_shape()
            if name in expected and tuple(shape) != expected[name]:
                raise CheckpointError(f"{folder}: tensor {stored} has shape {list(shape)}, config.json implies "
                                      f"{list(expected[name])}.")
            if len(shape) == 1:
                return read_runs(lambda a, b: hf_slice[a:b], rows, shape[0]).astype(dtype, copy=False)
            if cols is None:
                lo, hi = 0, shape[1]
            else:
                cols = np.asarray(cols, dtype=np.int64)
                lo, hi = int(cols.min()), int(cols.max()) + 1
            block = read_runs(lambda a, b: hf_slice[a:b, lo:hi], rows, shape[0])
            if cols is not None and not (len(cols) == hi - lo and np.array_equal(cols, np.arange(lo, hi))):
                block = np.take(block, cols - lo, axis=1)
            return block.astype(dtype, copy=False)

    return read


def prune_checkpoint(src: str | os.PathLike, plan: Plan, dst: str | os.PathLike, *, dtype=None,
                     revision: str | None = None, max_shard_size: int | str = "5GB",
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, report: bool = True) -> str:
    """Write the student `plan` describes, cut from the HF checkpoint `src`, as an HF folder `dst`.

    `dtype` defaults to the checkpoint's (as `load_pretrained`). `chunk_bytes` bounds the float32 block a recipe
    works on. `plan.json` (and, with `report`, the report as text and PNG) is written into `dst`."""
    from .apply import student_files

    folder = resolve_source(src, revision)
    config = GemmaConfig.from_file(folder)
    plan.check_teacher(config, where=f"checkpoint {folder}")
    plan.validate()
    weight_map = checkpoint_weight_map(folder)
    names, _ = canonical_names(weight_map)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    dtype = np.dtype(dtype or checkpoint_dtype(folder, config, weight_map, names))
    with contextlib.ExitStack() as stack:
        read = disk_reader(folder, dtype, stack, config)
        tensors = [PendingTensor(r.hf_name, r.shape, dtype,
                                 functools.partial(build, r, read, dtype, chunk_bytes)) for r in recipes(plan)]
        return write_hf_folder(os.fspath(dst), plan.student, tensors, source=folder, max_shard_size=max_shard_size,
                               extra_files=student_files(plan, report))
