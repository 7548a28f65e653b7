"""How each student tensor is made from teacher slices: one recipe per HF tensor, shared by both surgery paths.

A recipe follows from the tensor's named axes in the family schema (schema.py): `embed` keeps `kept_hidden`,
`mlp` keeps `kept_mlp`, `heads` keeps the query heads `kept_heads`, `kv_heads` are merged per `kv_groups`, `vocab`
keeps `kept_vocab` (whole when the plan has none); `head_dim` is kept whole. Nothing here names a family's
tensors.

`apply_plan` (teacher in memory) and `prune_checkpoint` (teacher on disk) differ only in how they read a block
of a teacher tensor: `read(hf_name, rows, cols, out=None)` returns the teacher's HF-layout tensor restricted to
those row and column indices (None = all), in the model dtype. Everything else, including the arithmetic, is this
module, in numpy float32 on the host, then cast to the model dtype. That is why the two paths agree bit for bit.
Plain copies need no arithmetic: the reader gathers them straight into the output tensor (`out=`).

Recipes work in HF layout ([out, in] matrices, head-major rows for q/k/v, head-major columns for o_proj), and
build their output a block of rows at a time, so host memory stays near the output tensor plus one block.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nnx_surgery.surgery.plans.plan_record import Plan
from nnx_surgery.surgery.storage.tensor_readers import Reader
from nnx_surgery.surgery.families.schema import bound_tensors, hf_shape_of
from nnx_surgery.surgery.families.schema import nnx_shape as schema_nnx_shape


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Student tensor `hf_name` (NNX `path`, `layout`, HF `shape`) from teacher tensor `source`.

    kind  copy   teacher[rows][:, cols]
          scale  teacher[rows][:, cols] * factor                  (embedding compensation)
          norm   (1 + teacher[rows]) * factor - 1                 (RMSNorm in the (1 + w) form, `offset`)
                 teacher[rows] * factor                           (RMSNorm in the plain w form)
          merge  rows block j = sum_i w_i * teacher[head g_i] / sum_i w_i, for (g_i, w_i) in merge[j]
    """

    hf_name: str
    path: tuple
    layout: str
    shape: tuple[int, ...]
    source: str
    kind: str
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    factor: float = 1.0
    merge: tuple = ()  # ((teacher heads...), (weights...)) per student head
    head_dim: int = 0
    offset: bool = True


def head_rows(heads, head_dim: int) -> np.ndarray:
    """HF row (or column) indices of whole heads: head h owns [h * head_dim, (h + 1) * head_dim)."""
    heads = np.asarray(heads, dtype=np.int64)
    return (heads[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def kept_indices(plan: Plan, layer: int | None) -> dict[str, np.ndarray | None]:
    """What the plan keeps along each named axis (teacher indices), at student layer `layer` (None: global
    tensors). `kv_heads` is not an index: those tensors are merged (`Recipe.merge`)."""
    vocab = None if plan.kept_vocab is None else np.asarray(plan.kept_vocab, dtype=np.int64)
    kept = {"embed": np.asarray(plan.kept_hidden, dtype=np.int64), "vocab": vocab, "head_dim": None}
    if layer is not None:
        kept["mlp"] = np.asarray(plan.kept_mlp[layer], dtype=np.int64)
        kept["heads"] = np.asarray(plan.flat_heads(layer), dtype=np.int64)
    return kept


def _hf_index(group: tuple[str, ...], kept: dict, head_dim: int) -> np.ndarray | None:
    """HF indices along one checkpoint axis made of `group`'s named axes (a head axis times head_dim, or one)."""
    index = kept[group[0]]
    if len(group) == 2 and index is not None:  # (heads, head_dim): whole heads
        return head_rows(index, head_dim)
    return index


def recipe_for(plan: Plan, student, tensor) -> Recipe:
    """The recipe of one student tensor (a schema.BoundTensor), by its named axes."""
    decl, layer = tensor.decl, tensor.layer
    shape = hf_shape_of(student, tensor)
    common = dict(hf_name=tensor.hf_name, path=tensor.path, layout=tensor.layout, shape=shape)
    source = tensor.hf_name if layer is None else decl.hf_name.replace("{i}", str(plan.kept_layers[layer]))
    kept = kept_indices(plan, layer)
    if "kv_heads" in decl.axes:  # always the leading checkpoint axis
        merge = tuple((tuple(g), tuple(w)) for g, w in zip(plan.kv_groups[layer], plan.kv_weights[layer]))
        cols = _hf_index(decl.groups[1], kept, student.head_dim) if len(decl.groups) > 1 else None
        return Recipe(**common, source=source, kind="merge", cols=cols, merge=merge, head_dim=student.head_dim)
    rows = _hf_index(decl.groups[0], kept, student.head_dim)
    cols = _hf_index(decl.groups[1], kept, student.head_dim) if len(decl.groups) > 1 else None
    if decl.role == "embedding":
        return Recipe(**common, source=source, kind="scale", rows=rows, cols=cols, factor=plan.embed_scale)
    if decl.norm:
        if decl.axes != ("embed",):  # q/k norms over head_dim: nothing pruned, nothing to compensate
            return Recipe(**common, source=source, kind="copy", rows=rows)
        factor = plan.final_norm_scale if layer is None else plan.layer_norm_scale(layer, tensor.module)
        return Recipe(**common, source=source, kind="norm", rows=rows, factor=factor, offset=student.norm_offset)
    return Recipe(**common, source=source, kind="copy", rows=rows, cols=cols)


def recipes(plan: Plan) -> list[Recipe]:
    """Every student tensor, in the order transformers writes them."""
    student = plan.student
    return [recipe_for(plan, student, tensor) for tensor in bound_tensors(student)]


def build_tensor(recipe: Recipe, read: Reader, dtype, chunk_bytes: int | None = None) -> np.ndarray:
    """The student tensor (HF layout, `dtype`), made `chunk_bytes` of float32 rows at a time (None: at once)."""
    dtype = np.dtype(dtype)
    out = np.empty(recipe.shape, dtype)
    if recipe.kind == "merge":
        h = recipe.head_dim
        for j, (heads, weights) in enumerate(recipe.merge):
            block = slice(j * h, (j + 1) * h)
            if len(heads) == 1:  # kept as is: no arithmetic, bits preserved
                read(recipe.source, head_rows(heads, h), recipe.cols, out=out[block])
                continue
            acc = None
            for head, weight in zip(heads, weights):
                part = read(recipe.source, head_rows([head], h), recipe.cols).astype(np.float32)
                part = part if weight == 1.0 else part * np.float32(weight)
                acc = part if acc is None else acc + part
            out[block] = (acc / np.float32(sum(weights))).astype(dtype)
        return out
    rows = recipe.rows if recipe.rows is not None else np.arange(recipe.shape[0])
    row_bytes = 4 * int(np.prod(recipe.shape[1:], dtype=np.int64)) if len(recipe.shape) > 1 else 4
    step = len(rows) if chunk_bytes is None else max(1, chunk_bytes // max(row_bytes, 1))
    plain = recipe.kind == "copy" or recipe.factor == 1.0
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        index = chunk if recipe.rows is not None or step < len(rows) else None
        if plain:  # gathered straight into the output, in the reader's (the model's) dtype
            read(recipe.source, index, recipe.cols, out=out[start:start + len(chunk)])
        else:
            out[start:start + len(chunk)] = _arithmetic(recipe, read(recipe.source, index, recipe.cols), dtype)
    return out


def _arithmetic(recipe: Recipe, block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    factor = np.float32(recipe.factor)
    if recipe.kind == "scale":
        return (block.astype(np.float32) * factor).astype(dtype)
    if recipe.kind == "norm" and recipe.offset:
        return ((np.float32(1.0) + block.astype(np.float32)) * factor - np.float32(1.0)).astype(dtype)
    if recipe.kind == "norm":
        return (block.astype(np.float32) * factor).astype(dtype)
    raise AssertionError(recipe.kind)


def nnx_shape_at(config, path: tuple) -> tuple[int, ...]:
    """The NNX shape of the parameter at `path` (a tensor_table path) for `config`."""
    for tensor in bound_tensors(config):
        if tensor.path == tuple(path):
            return schema_nnx_shape(config, tensor)
    raise KeyError(f"{config.model_type} has no parameter {'.'.join(map(str, path))}")
