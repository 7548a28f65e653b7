"""How each student tensor is made from teacher slices: one recipe per HF tensor, shared by both surgery paths.

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
from typing import Callable

import numpy as np

from .checkpoint import hf_shape, tensor_table
from .config import GemmaConfig
from .plan import Plan

# read(hf_name, rows, cols, out=None): the teacher's HF-layout tensor restricted to `rows` and `cols` (index arrays,
# None = all), in the model dtype; written into `out` (a C-contiguous array of the result's shape) when given.
Reader = Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Student tensor `hf_name` (NNX `path`, `layout`, HF `shape`) from teacher tensor `source`.

    kind  copy   teacher[rows][:, cols]
          scale  teacher[rows][:, cols] * factor                  (embedding compensation)
          norm   (1 + teacher[rows]) * factor - 1                 (RMSNorm (1 + w) parameterisation)
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


def head_rows(heads, head_dim: int) -> np.ndarray:
    """HF row (or column) indices of whole heads: head h owns [h * head_dim, (h + 1) * head_dim)."""
    heads = np.asarray(heads, dtype=np.int64)
    return (heads[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def recipes(plan: Plan) -> list[Recipe]:
    """Every student tensor, in the order transformers writes them."""
    student = plan.student
    head_dim = student.head_dim
    hidden = np.asarray(plan.kept_hidden, dtype=np.int64)
    tied = student.tie_word_embeddings
    out = []
    for entry in tensor_table(student):
        shape = hf_shape(entry.layout, nnx_shape(student, entry.path))
        common = dict(hf_name=entry.hf_name, path=entry.path, layout=entry.layout, shape=shape)
        if entry.path[0] == "embed_tokens":
            out.append(Recipe(**common, source=entry.hf_name, kind="scale", cols=hidden, factor=plan.embed_scale))
            continue
        if entry.path[0] == "norm":
            out.append(Recipe(**common, source=entry.hf_name, kind="norm", rows=hidden,
                              factor=plan.final_norm_scale))
            continue
        if entry.path[0] == "lm_head":  # untied head: kept hidden columns, no compensation factor
            assert not tied
            out.append(Recipe(**common, source=entry.hf_name, kind="copy", cols=hidden))
            continue
        s = entry.path[1]
        teacher_layer = plan.kept_layers[s]
        source = entry.hf_name.replace(f"model.layers.{s}.", f"model.layers.{teacher_layer}.", 1)
        module, name = entry.path[2], entry.path[-2]
        heads = head_rows(plan.flat_heads(s), head_dim)
        mlp = np.asarray(plan.kept_mlp[s], dtype=np.int64)
        if module.endswith("layernorm"):
            recipe = Recipe(**common, source=source, kind="norm", rows=hidden,
                            factor=plan.layer_norm_scale(s, module))
        elif name in ("q_norm", "k_norm"):
            recipe = Recipe(**common, source=source, kind="copy")
        elif name == "q_proj":
            recipe = Recipe(**common, source=source, kind="copy", rows=heads, cols=hidden)
        elif name in ("k_proj", "v_proj"):
            merge = tuple((tuple(g), tuple(w)) for g, w in zip(plan.kv_groups[s], plan.kv_weights[s]))
            recipe = Recipe(**common, source=source, kind="merge", cols=hidden, merge=merge, head_dim=head_dim)
        elif name == "o_proj":
            recipe = Recipe(**common, source=source, kind="copy", rows=hidden, cols=heads)
        elif name in ("gate_proj", "up_proj"):
            recipe = Recipe(**common, source=source, kind="copy", rows=mlp, cols=hidden)
        elif name == "down_proj":
            recipe = Recipe(**common, source=source, kind="copy", rows=hidden, cols=mlp)
        else:  # pragma: no cover - tensor_table and this function list the same tensors
            raise AssertionError(f"no recipe for {entry.hf_name}")
        out.append(recipe)
    return out


def build(recipe: Recipe, read: Reader, dtype, chunk_bytes: int | None = None) -> np.ndarray:
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
    if recipe.kind == "norm":
        return ((np.float32(1.0) + block.astype(np.float32)) * factor - np.float32(1.0)).astype(dtype)
    raise AssertionError(recipe.kind)


def nnx_shape(config: GemmaConfig, path: tuple) -> tuple[int, ...]:
    d, f, n, k, h, v = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                        config.num_key_value_heads, config.head_dim, config.vocab_size)
    if path[0] == "embed_tokens":
        return (v, d)
    if path[0] == "lm_head":
        return (v, d)
    if path[0] == "norm":
        return (d,)
    name = path[-2]
    return {"q_proj": (n, h, d), "k_proj": (k, h, d), "v_proj": (k, h, d), "o_proj": (d, n, h),
            "q_norm": (h,), "k_norm": (h,), "gate_proj": (f, d), "up_proj": (f, d),
            "down_proj": (d, f)}.get(name, (d,))
