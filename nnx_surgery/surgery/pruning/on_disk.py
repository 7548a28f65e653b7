"""`prune_checkpoint`: the surgery from an HF checkpoint on disk straight to a student HF folder.

Teacher tensors are never materialised: each student tensor is produced only when the writer reaches it, from
`preadv` reads of the kept rows (contiguous runs), the kept columns gathered while copying into the output, a
block of rows at a time (`surgery.pruning.tensor_readers.DiskReader`); two threads build the next two tensors while the writer
writes the current one (one gathers columns while the other waits on the disk). Peak host memory is about three
student tensors plus a block per thread, so a teacher becomes a student on a machine with far less memory than
the teacher's weights.

The result equals `save_student(apply_plan(load_pretrained(src), plan), plan, dst)` bit for bit: same recipes,
same host arithmetic, same writer.

Multi-host (`jax.distributed`): every process calls it with the same arguments; each checks the plan against the
checkpoint, process 0 alone writes `dst` (shared storage), and every process returns once the folder is complete
(a barrier), so all can load it next.
"""
from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from ..storage.hf_checkpoint import checkpoint_dtype, resolve_dtype, resolve_source, write_hf_folder
from ..modeling.model_config import ModelConfig
from nnx_surgery.surgery.plans.plan_record import Plan
from nnx_surgery.surgery.storage.tensor_readers import DiskReader
from nnx_surgery.surgery.plans.plan_report import student_files
from ..storage.safetensors_stream import PendingTensor
from ..storage.shared_writes import multi_host, process_0_writes
from .tensor_slices import build_tensor, recipes
from nnx_surgery.surgery.pruning.tokenizer_files import student_tokenizer

DEFAULT_CHUNK_BYTES = 16 << 20
PRODUCE_AHEAD = 2  # student tensors built at once while one is written: one thread gathers while another reads


def prune_checkpoint(src: str | os.PathLike, plan: Plan, dst: str | os.PathLike, *, dtype=None,
                     revision: str | None = None, max_shard_size: int | str = "5GB",
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, report: bool = True, overwrite: bool = False) -> str:
    """Write the student `plan` describes, cut from the HF checkpoint `src`, as an HF folder `dst`.

    `dtype` is the student's: None or "auto" keeps the checkpoint's (as `load_pretrained`); else a name such as
    "bfloat16" or "bf16", or a numpy, jnp or torch dtype (ValueError for anything else). `chunk_bytes` bounds the
    float32 block a recipe works on. `plan.json` (and, with `report`, the report as text and PNG) is written into
    `dst`; an existing non-empty `dst` is refused unless `overwrite=True`."""
    wanted = resolve_dtype(dtype)  # before any reading: a bad name fails at once
    folder = resolve_source(src, revision)
    config = ModelConfig.from_file(folder)
    float32_read = DiskReader(folder, np.float32, None, config)  # for the plan's weight fingerprint
    plan.check_teacher(config, where=f"checkpoint {folder}", read=float32_read)
    plan.validate()
    if wanted is None:
        wanted = np.dtype(checkpoint_dtype(folder, config, float32_read.weight_map, float32_read.names))
    dst = os.fspath(dst)
    def write() -> str:
        return _write_student(folder, plan, dst, config, wanted, max_shard_size=max_shard_size,
                              chunk_bytes=chunk_bytes, report=report, overwrite=overwrite)

    if multi_host():  # process 0 writes dst; every process returns once it is complete
        return process_0_writes(dst, overwrite, write, name="prune_checkpoint")
    return write()


def _write_student(folder: str, plan: Plan, dst: str, config: ModelConfig, wanted, *, max_shard_size: int | str,
                   chunk_bytes: int, report: bool, overwrite: bool) -> str:
    source, tokenizer_files = student_tokenizer(plan, folder)  # trimmed tokenizer files for a kept_vocab
    with contextlib.ExitStack() as stack:
        read = DiskReader(folder, wanted, stack, config)
        tensors = [PendingTensor(r.hf_name, r.shape, wanted, functools.partial(build_tensor, r, read, wanted, chunk_bytes))
                   for r in recipes(plan)]
        return write_hf_folder(dst, plan.student, tensors, source=source, max_shard_size=max_shard_size,
                               extra_files={**student_files(plan, report), **tokenizer_files},
                               produce_ahead=PRODUCE_AHEAD, overwrite=overwrite)
