"""Hugging Face checkpoint <-> NNX model: the tensor table, streaming load and streaming save.

`tensor_table(config)` lists every HF tensor with the NNX parameter it fills and how the layout changes, read
from the family's tensor schema (schema.py). The model keeps HF's own layouts (nnx_surgery/surgery/modeling/causal_lm.py), so the only
change is a reshape that names the head axes:

    same        norms, embedding, gate/up/down, lm_head     identical
    split_rows  q/k/v_proj                                  HF [N*H, D] -> (N, H, D)
    split_cols  o_proj                                      HF [D, N*H] -> (D, N, H)
    flat        q/k/v_proj biases (Qwen2)                   HF [N*H] -> (N, H)

Loading builds the model abstractly (no memory), checks every tensor against it, then reads each parameter once,
straight into 64-byte-aligned host buffers that XLA:CPU adopts without copying (`surgery.storage.block_reads`: row
pieces on two threads). Saving writes tensor by tensor into a temporary folder that is renamed into place at the
end, producing the next tensor while the current one is written.
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..modeling.model_config import ModelConfig
from ..modeling.causal_lm import CausalLM, abstract_model
from nnx_surgery.surgery.families.schema import bound_tensors
from ..modeling.sharding import parameter_sharding
from .block_reads import LoadJob, fill_parameters
from .dtypes import STORED_DTYPES, resolve_dtype, torch_dtype_name  # noqa: F401  (re-exported)
from .gguf_import import cached_import
from .shared_writes import process_0_writes
from .safetensors_stream import (CheckpointError, PendingTensor, atomic_folder, check_relative_name,
                                 checkpoint_weight_map, copy_aux_files, iter_groups_by_file, open_safetensors,
                                 write_json, write_model_files)

# Checkpoint name prefixes that belong to parts of a multimodal Gemma 3 we do not build.
IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                 "language_model.lm_head.": "lm_head."}
@dataclass(frozen=True)
class TensorEntry:
    hf_name: str
    path: tuple  # NNX state path, e.g. ("layers", 0, "self_attn", "q_proj", "weight")
    layout: str  # same | split_rows | split_cols | flat
    axes: tuple[str, ...] = ()  # the NNX parameter's named axes (schema.py)


def tensor_table(config: ModelConfig) -> list[TensorEntry]:
    """Every tensor of an HF checkpoint for `config`, in the order transformers writes them (from the family's
    tensor schema)."""
    return [TensorEntry(t.hf_name, t.path, t.layout, t.axes) for t in bound_tensors(config)]


def hf_shape(layout: str, nnx_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint's shape of a parameter of NNX shape `nnx_shape`."""
    if layout == "same":
        return tuple(nnx_shape)
    if layout == "split_rows":  # (N, H, D) -> [N*H, D]
        return (nnx_shape[0] * nnx_shape[1], nnx_shape[2])
    if layout == "flat":  # (N, H) -> [N*H] (a bias over heads)
        return (nnx_shape[0] * nnx_shape[1],)
    return (nnx_shape[0], nnx_shape[1] * nnx_shape[2])  # split_cols (D, N, H) -> [D, N*H]


def to_hf_layout(layout: str, array: np.ndarray) -> np.ndarray:
    """The HF-shaped view of an NNX parameter (a reshape; no data moves for a contiguous array)."""
    return array.reshape(hf_shape(layout, array.shape))


def read_nnx_block(hf_slice, layout: str, nnx_shape: tuple[int, ...], index: tuple) -> np.ndarray:
    """Read the block `index` (slices into the NNX shape) of a parameter from an HF `get_slice` handle or a
    numpy array in HF layout. Whole head rows (or columns) are one contiguous range, so this is a slice and a
    reshape; the head_dim axis is only cut when a mesh shards it."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, nnx_shape)] if index else [(0, n) for n in nnx_shape]
    if layout == "same":
        return hf_slice[tuple(slice(a, b) for a, b in bounds)]
    if layout == "flat":  # block (n, h) of (N, H) from [N*H]
        (n0, n1), (h0, h1) = bounds
        head_dim = nnx_shape[1]
        block = hf_slice[n0 * head_dim:n1 * head_dim].reshape(n1 - n0, head_dim)
        return block if h1 - h0 == head_dim else np.ascontiguousarray(block[:, h0:h1])
    if layout == "split_rows":  # block (n, h, d) of (N, H, D) from [N*H, D]
        (n0, n1), (h0, h1), (d0, d1) = bounds
        head_dim = nnx_shape[1]
        block = hf_slice[n0 * head_dim:n1 * head_dim, d0:d1].reshape(n1 - n0, head_dim, d1 - d0)
        return block if h1 - h0 == head_dim else np.ascontiguousarray(block[:, h0:h1, :])
    (d0, d1), (n0, n1), (h0, h1) = bounds  # split_cols: block (d, n, h) of (D, N, H) from [D, N*H]
    head_dim = nnx_shape[2]
    block = hf_slice[d0:d1, n0 * head_dim:n1 * head_dim].reshape(d1 - d0, n1 - n0, head_dim)
    return block if h1 - h0 == head_dim else np.ascontiguousarray(block[:, :, h0:h1])


# ------------------------------------------------------------------------------------------------ loading
def resolve_source(source: str | os.PathLike, revision: str | None = None) -> str:
    """A local folder, or a Hub repo id fetched into the HF cache (honours HF_HUB_OFFLINE and HF_HOME)."""
    source = os.path.expanduser(os.fspath(source))
    if os.path.isdir(source):
        return source
    if os.path.exists(source):
        raise CheckpointError(f"{source} is a file; pass the model folder that holds config.json.")
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
    try:
        if not constants.is_offline_mode():  # names from the Hub's listing stay inside the snapshot folder
            for sibling in HfApi().model_info(source, revision=revision).siblings or []:
                if any(fnmatch.fnmatchcase(sibling.rfilename, p) for p in patterns):
                    check_relative_name(sibling.rfilename, f"Hub repo {source} (revision {revision or 'main'})",
                                        "the repo")
        return snapshot_download(source, revision=revision, allow_patterns=patterns)
    except CheckpointError:
        raise
    except HFValidationError:
        raise CheckpointError(f"{source!r} is neither a local folder nor a valid Hub repo id.") from None
    except Exception as err:  # offline, missing repo, no access: say which and how to fix it
        raise CheckpointError(f"could not fetch {source!r} (revision {revision or 'main'}) from the Hub: "
                              f"{type(err).__name__}: {err}. Pass a local folder, log in with `hf auth login`, "
                              "or unset HF_HUB_OFFLINE.") from None


def canonical_names(weight_map: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Map checkpoint names to text-model HF names (`language_model.model.*` -> `model.*`); list ignored ones."""
    canonical, ignored = {}, []
    for name in weight_map:
        if name.startswith(IGNORED_PREFIXES):
            ignored.append(name)
            continue
        mapped = name
        for prefix, replacement in TEXT_PREFIXES.items():
            if name.startswith(prefix):
                mapped = replacement + name[len(prefix):]
                break
        canonical[mapped] = name
    return canonical, ignored


def checkpoint_dtype(folder: str, config: ModelConfig, weight_map: dict[str, str], names: dict[str, str]):
    """The checkpoint's stored dtype, which decides the model dtype when none is asked for. A checkpoint whose
    tensors mix dtypes has none: CheckpointError naming a tensor of each (pass dtype= to convert them all)."""
    seen: dict[str, tuple[str, str]] = {}  # dtype code -> (file, a tensor stored in it)
    wanted = set(names.values())
    for file_name, stored_names in iter_groups_by_file(sorted(wanted), weight_map).items():
        path = os.path.join(folder, file_name)
        with open_safetensors(path) as f:
            for stored in stored_names:
                seen.setdefault(_get_slice(f, stored, path).get_dtype(), (path, stored))
    for code, (path, stored) in seen.items():
        if code not in STORED_DTYPES:
            raise CheckpointError(f"{path}: tensor {stored} has dtype {code}; expected F32, BF16 or F16.")
    if len(seen) > 1:
        examples = "; ".join(f"{stored} is {code} (in {os.path.basename(path)})"
                             for code, (path, stored) in sorted(seen.items()))
        raise CheckpointError(f"{folder}: tensors are stored in mixed dtypes ({examples}), so the model dtype is "
                              "ambiguous; pass dtype='float32', 'bfloat16' or 'float16' to convert them all.")
    return STORED_DTYPES[next(iter(seen))]


def _get_slice(f, name: str, path: str):
    try:
        return f.get_slice(name)
    except Exception:  # SafetensorError; the index points at a file without the tensor
        raise CheckpointError(f"{path}: does not contain tensor {name}, although the index says it does; "
                              "the checkpoint is incomplete or its index is stale.") from None


def load_pretrained(source: str | os.PathLike, *, dtype=None, mesh=None, revision: str | None = None,
                    check_finite: bool = False) -> CausalLM:
    """Load an HF checkpoint (Gemma 1/2/3, Llama, Mistral, Qwen2) into an NNX model, streaming, sharded over
    `mesh` when given.

    `dtype` (jnp/numpy dtype or "float32"/"bfloat16"/"float16") defaults to the checkpoint's own dtype.
    Raises ConfigError for an unusable config.json and CheckpointError (naming file and tensor) when the
    tensors do not match it: never returns a model with unfilled or random weights. `check_finite`: also
    refuse NaN or infinite weights (one more pass over the loaded parameters, on their devices), including
    values that overflow when converted to `dtype`. A `.gguf` file is imported once into a cached HF folder
    (`surgery.storage.gguf_import.cached_import`; float32 unless `dtype` asks otherwise: dequantised values are exact there).
    """
    dtype = resolve_dtype(dtype)
    if os.fspath(source).endswith(".gguf") and os.path.isfile(source):
        source = cached_import(source, "float32" if dtype is None else jnp.dtype(dtype).name)
    folder = resolve_source(source, revision)
    config = ModelConfig.from_file(folder)
    weight_map = checkpoint_weight_map(folder)
    names, ignored = canonical_names(weight_map)
    table = tensor_table(config)
    expected = {entry.hf_name for entry in table}
    if config.tie_word_embeddings and "lm_head.weight" in names:
        expected.add("lm_head.weight")  # some exports write the tied head too; it must equal the embedding
    missing = sorted(expected - set(names))
    if missing:
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                              f"{missing[:3]}; the files do not match config.json.")
    unexpected = sorted(set(names) - expected)
    if unexpected:
        raise CheckpointError(f"{folder}: checkpoint has {len(unexpected)} tensor(s) a {config.model_type} model "
                              f"with this config does not use, e.g. {unexpected[:3]} "
                              f"(in {weight_map[names[unexpected[0]]]}).")
    if config.tie_word_embeddings and "lm_head.weight" in names:
        _check_tied_head(folder, weight_map, names)
    if dtype is None:
        dtype = checkpoint_dtype(folder, config, weight_map, names)
    model = abstract_model(config, dtype=dtype, mesh=mesh)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    by_name = {names[e.hf_name]: e for e in table}
    with contextlib.ExitStack() as stack:
        jobs = []  # every tensor checked against the config before anything is read
        for file_name, hf_names in iter_groups_by_file([names[e.hf_name] for e in table], weight_map).items():
            path = os.path.join(folder, file_name)
            f = stack.enter_context(open_safetensors(path))
            for stored_name in hf_names:
                entry = by_name[stored_name]
                jobs.append(_load_job(variables[entry.path], _get_slice(f, stored_name, path), entry, path,
                                      stored_name, dtype, mesh))
        fill_parameters(jobs, lambda job, index: read_nnx_block(job.hf_slice, job.layout, job.shape, index))
    if check_finite:
        for entry in table:
            _check_finite(variables[entry.path], os.path.join(folder, weight_map[names[entry.hf_name]]),
                          names[entry.hf_name], dtype)
    return nnx.merge(graphdef, state)


def _check_finite(variable, path: str, name: str, dtype) -> None:
    bad = int(jnp.sum(~jnp.isfinite(variable[...])))
    if bad:
        raise CheckpointError(f"{path}: tensor {name} has {bad} NaN or infinite value(s) once loaded as "
                              f"{np.dtype(dtype).name}; the checkpoint is damaged (or overflows that dtype).")


def _load_job(variable, hf_slice, entry: TensorEntry, path: str, name: str, dtype, mesh) -> LoadJob:
    nnx_shape = tuple(variable.shape)
    want = hf_shape(entry.layout, nnx_shape)
    found = tuple(hf_slice.get_shape())
    if found != want:
        raise CheckpointError(f"{path}: tensor {name} has shape {list(found)}, config.json implies {list(want)}.")
    if hf_slice.get_dtype() not in STORED_DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has dtype {hf_slice.get_dtype()}; expected F32, BF16 or F16.")
    return LoadJob(variable, hf_slice, entry.layout, nnx_shape, np.dtype(dtype), parameter_sharding(variable, mesh))


def _check_tied_head(folder, weight_map, names, rows_per_read: int = 8192) -> None:
    """A tied checkpoint that also stores lm_head.weight: it must equal the embedding (compared in row blocks,
    so the check costs two blocks of memory, not two copies of the vocabulary matrix)."""
    head_name, embed_name = names["lm_head.weight"], names["model.embed_tokens.weight"]
    head_path = os.path.join(folder, weight_map[head_name])
    embed_path = os.path.join(folder, weight_map[embed_name])
    with open_safetensors(head_path) as fh, open_safetensors(embed_path) as fe:
        head, embed = _get_slice(fh, head_name, head_path), _get_slice(fe, embed_name, embed_path)
        same = head.get_shape() == embed.get_shape() and head.get_dtype() == embed.get_dtype()
        rows = head.get_shape()[0] if same else 0
        for start in range(0, rows, rows_per_read):
            stop = min(start + rows_per_read, rows)  # get_slice does not clamp
            if not np.array_equal(head[start:stop], embed[start:stop]):
                same = False
                break
    if not same:
        raise CheckpointError(f"{head_path}: tie_word_embeddings is true but {head_name} differs from the "
                              "embedding; set tie_word_embeddings=false in config.json to load an untied head.")


# ------------------------------------------------------------------------------------------------ saving
def gathered(array) -> np.ndarray:
    """The whole of `array` on this host. On CPU a view of the device buffer; a parameter sharded over several
    processes (multi-host) is gathered with `process_allgather`, a collective every process must call in the
    same order; a replicated one is read from a local copy."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def model_tensors(model: CausalLM, dtype=None) -> list[PendingTensor]:
    """The model's tensors in HF names and layout, each produced (gathered to host) only when written."""
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = []
    for entry in tensor_table(model.config):
        variable = state[entry.path]
        out_dtype = np.dtype(variable.dtype if dtype is None else dtype)

        def produce(variable=variable, layout=entry.layout, out_dtype=out_dtype):
            # The gather (on CPU a view of the device buffer); the HF layout is a reshape, so a copy is made
            # only to change the dtype.
            return np.asarray(to_hf_layout(layout, gathered(variable[...])), dtype=out_dtype)

        tensors.append(PendingTensor(entry.hf_name, hf_shape(entry.layout, tuple(variable.shape)), out_dtype,
                                     produce))
    return tensors


def write_hf_folder(out_dir: str, config: ModelConfig, tensors: list[PendingTensor], *, source: str | None = None,
                    max_shard_size: int | str = "5GB", extra_files: Mapping[str, object] | None = None,
                    produce_ahead: int = 1, overwrite: bool = False) -> str:
    """Write config.json, safetensors and the teacher's tokenizer files into `out_dir`, atomically.

    `extra_files` maps a file name to JSON data (e.g. the surgery plan) or to a callable `(path) -> None`.
    `produce_ahead` tensors are produced on as many threads while one is written. An existing non-empty
    `out_dir` is a CheckpointError unless `overwrite=True` (replaced only once the new folder is complete)."""
    dtype = torch_dtype_name(tensors[0].dtype) if tensors else "float32"
    with atomic_folder(out_dir, overwrite=overwrite) as tmp:
        write_model_files(tmp, tensors, max_shard_size, ahead=produce_ahead)
        write_json(os.path.join(tmp, "config.json"), config.to_hf_dict(dtype=dtype))
        if source:
            copy_aux_files(resolve_source(source) if not os.path.isdir(source) else source, tmp)
        for name, content in (extra_files or {}).items():
            if callable(content):
                content(os.path.join(tmp, name))
            else:
                write_json(os.path.join(tmp, name), content)
    return os.path.abspath(out_dir)


def save_pretrained(model: CausalLM, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None,
                    dtype=None, max_shard_size: int | str = "5GB",
                    extra_files: Mapping[str, object] | None = None, overwrite: bool = False) -> str:
    """Write `model` as an HF folder transformers loads (`AutoModelForCausalLM.from_pretrained(out_dir)`).

    `source` (the teacher's folder or repo id) supplies tokenizer and generation config. `dtype` converts on the
    way out (default: the parameters' dtype). An existing non-empty `out_dir` is refused unless `overwrite=True`.
    Returns the folder's absolute path."""
    dtype = resolve_dtype(dtype)
    tensors = model_tensors(model, dtype)
    if jax.process_count() > 1:
        return _save_multihost(os.fspath(out_dir), model.config, tensors, source=os.fspath(source) if source
                               else None, max_shard_size=max_shard_size, extra_files=extra_files,
                               overwrite=overwrite)
    return write_hf_folder(os.fspath(out_dir), model.config, tensors,
                           source=os.fspath(source) if source else None, max_shard_size=max_shard_size,
                           extra_files=extra_files, overwrite=overwrite)


def _save_multihost(out_dir: str, config: ModelConfig, tensors: list[PendingTensor], **options) -> str:
    """Multi-host save (every process calls it): tensors are gathered one at a time, in the same order on every
    process (their gathers are collectives; one producer thread keeps the order), and process 0 writes the
    folder (shared_writes.py). No process holds more than the tensor being written plus the one gathered ahead."""
    def take_part() -> None:
        for tensor in tensors:
            tensor.produce()  # each gather, in order, while process 0 writes

    return process_0_writes(out_dir, bool(options.get("overwrite")),
                            lambda: write_hf_folder(out_dir, config, tensors, produce_ahead=1, **options),
                            take_part, name="save_pretrained")
