"""The two teacher readers agree block for block, and `prune_checkpoint` takes the dtypes `load_pretrained` does."""
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_surgery.surgery import ModelConfig, create_model, save_pretrained
from nnx_surgery.surgery.storage.hf_checkpoint import tensor_table
from nnx_surgery.surgery.modeling.model_config import SUPPORTED_MODEL_TYPES
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint
from nnx_surgery.surgery.storage.tensor_readers import DiskReader, MemoryReader, Reader, expected_hf_shapes
from nnx_surgery.surgery.storage.safetensors_stream import CheckpointError
from nnx_surgery.surgery.pruning.tensor_slices import head_rows
from nnx_surgery.surgery.plans.student_spec import StudentSpec

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8,
         "sliding_window": 4}
CONFIG = ModelConfig.from_hf_dict({"model_type": "gemma2", **SIZES})
SPEC = StudentSpec(1, 24, 32, 2, 1)


def random_model(config, seed: int = 3):
    """A model whose every parameter (biases and norms too, which initialise constant) is distinct noise."""
    model = create_model(config, seed=seed)
    rng = np.random.default_rng(seed)
    noise = lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)  # noqa: E731
    nnx.update(model, jax.tree.map(noise, nnx.state(model, nnx.Param)))
    return model


@pytest.fixture(scope="module")
def teacher():
    return random_model(CONFIG)


@pytest.fixture(scope="module")
def folders(teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    return {"float32": save_pretrained(teacher, root / "f32"),
            "bfloat16": save_pretrained(teacher, root / "bf16", dtype="bfloat16", max_shard_size="8KB")}


def _selection(entry, shape, rng):
    """Rows and columns to read: whole heads on the head-structured axis, any indices (unsorted) elsewhere."""
    rows = rng.permutation(shape[0])[: max(1, shape[0] // 2)]
    cols = rng.permutation(shape[1])[: max(1, shape[1] // 3)] if len(shape) == 2 else None
    if entry.layout in ("split_rows", "flat"):  # q/k/v weights and per-head biases
        rows = head_rows(rng.permutation(shape[0] // CONFIG.head_dim)[:1], CONFIG.head_dim)
    if entry.layout == "split_cols":
        cols = head_rows(rng.permutation(shape[1] // CONFIG.head_dim)[:2], CONFIG.head_dim)
    return rows, cols


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_memory_and_disk_readers_agree_on_every_tensor(model_type, teacher, folders, tmp_path):
    config = ModelConfig.from_hf_dict({"model_type": model_type, **SIZES})
    model = teacher if config == CONFIG else random_model(config)
    folder = folders["float32"] if config == CONFIG else save_pretrained(model, tmp_path / model_type)
    rng = np.random.default_rng(0)
    memory, disk = MemoryReader(model), DiskReader(folder, np.float32, config=config)
    assert isinstance(memory, Reader) and isinstance(disk, Reader)
    shapes = expected_hf_shapes(config)
    for entry in tensor_table(config):
        shape = shapes[entry.hf_name]
        whole = disk(entry.hf_name, None, None)
        assert whole.shape == shape and whole.dtype == np.float32
        np.testing.assert_array_equal(memory(entry.hf_name, None, None), whole)
        rows, cols = _selection(entry, shape, rng)
        want = whole[rows] if cols is None else whole[rows][:, cols]
        np.testing.assert_array_equal(memory(entry.hf_name, rows, cols), want, err_msg=entry.hf_name)
        out = np.zeros(want.shape, np.float32)
        assert disk(entry.hf_name, rows, cols, out=out) is out
        np.testing.assert_array_equal(out, want, err_msg=entry.hf_name)


def test_disk_reader_checks_shapes_against_the_config(folders):
    wider = CONFIG.replace(intermediate_size=64)
    read = DiskReader(folders["float32"], np.float32, config=wider)
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape \\[48, 32\\], config.json implies "
                                              "\\[64, 32\\]"):
        read("model.layers.0.mlp.gate_proj.weight", None, None)
    with pytest.raises(CheckpointError, match="no tensor model.layers.9.mlp.up_proj.weight"):
        read("model.layers.9.mlp.up_proj.weight", None, None)


def test_expected_shapes_follow_the_hf_layout():
    shapes = expected_hf_shapes(CONFIG)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 8, 32)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (32, 4 * 8)
    assert shapes["model.embed_tokens.weight"] == (64, 32)
    assert set(shapes) == {e.hf_name for e in tensor_table(CONFIG)}


def _stored_dtypes(folder) -> set[str]:
    dtypes = set()
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes


@pytest.mark.parametrize("source, dtype, stored", [
    ("bfloat16", "auto", "BF16"),       # "auto" and None keep the checkpoint's dtype
    ("float32", None, "F32"),
    ("float32", "bf16", "BF16"),        # the short names load_pretrained takes
    ("bfloat16", jnp.float32, "F32"),   # jnp, numpy and torch dtypes
    ("float32", np.float16, "F16"),
    ("float32", torch.bfloat16, "BF16"),
    ("bfloat16", ml_dtypes.bfloat16, "BF16"),
])
def test_prune_checkpoint_dtypes(folders, tmp_path, source, dtype, stored):
    plan = plan_student(folders[source], SPEC)
    out = prune_checkpoint(folders[source], plan, tmp_path / "student", dtype=dtype, report=False)
    assert _stored_dtypes(out) == {stored}
    with open(os.path.join(out, "config.json")) as f:
        assert f.read().count('"hidden_size": 24') == 1


def test_prune_checkpoint_refuses_an_unknown_dtype_before_writing(folders, tmp_path):
    plan = plan_student(folders["float32"], SPEC)
    for bad in ("float8", "int8", np.int32):
        with pytest.raises(ValueError, match="is not supported; use float32, bfloat16 or float16"):
            prune_checkpoint(folders["float32"], plan, tmp_path / "student", dtype=bad)
    assert not os.path.exists(tmp_path / "student")
