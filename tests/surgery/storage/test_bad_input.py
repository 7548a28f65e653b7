"""Broken checkpoints and configs give a CheckpointError / ConfigError that names the file or tensor, never a deep
traceback and never a model with silently random weights."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_reference import make_hf_model, max_abs_diff, sample_ids
from nnx_surgery.surgery import CheckpointError, ConfigError, ModelConfig, load_pretrained
from nnx_surgery.surgery.storage.hf_checkpoint import _check_tied_head, canonical_names
from nnx_surgery.surgery.storage.safetensors_stream import INDEX_FILE, checkpoint_weight_map
from recipe_env import with_host_devices
from refusal_env import tree  # every file's sha256 under a folder

NORM = "model.layers.1.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid gemma2 checkpoint, single file and sharded; tests copy it before breaking it."""
    root = tmp_path_factory.mktemp("good")
    model = make_hf_model("gemma2", seed=3, num_hidden_layers=2, layer_types=None)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


@pytest.fixture
def ckpt(good, tmp_path):
    def copy(kind: str = "single") -> str:
        target = tmp_path / kind
        shutil.copytree(good / kind, target)
        return str(target)

    return copy


def _rewrite(folder: str, change) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    for key, value in changes.items():
        if value is _DELETE:
            del config[key]
    with open(path, "w") as f:
        json.dump(config, f)


_DELETE = object()


def _raises(error, folder: str, *fragments: str):
    with pytest.raises(error) as info:
        load_pretrained(folder)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert info.value.__cause__ is None  # no chained low-level exception behind it
    return message


def test_good_checkpoint_loads(good):
    assert load_pretrained(good / "single").config.num_hidden_layers == 2


def test_truncated_file(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    _raises(CheckpointError, folder, path, "truncated")


def test_file_shorter_than_its_header(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, 5)
    _raises(CheckpointError, folder, path, "truncated")


def test_corrupt_header(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00{{not json")
    _raises(CheckpointError, folder, path, "corrupt")


def test_missing_tensor(ckpt):
    folder = ckpt()
    _rewrite(folder, lambda t: t.pop(NORM))
    _raises(CheckpointError, folder, NORM, "lacks")


def test_wrong_shape(ckpt):
    folder = ckpt()
    name = "model.layers.0.self_attn.k_proj.weight"

    def change(tensors):
        tensors[name] = np.zeros((12, 32), np.float32)  # one KV head instead of two

    _rewrite(folder, change)
    _raises(CheckpointError, folder, name, "[12, 32]", "[24, 32]")


def test_unexpected_extra_tensor(ckpt):
    folder = ckpt()
    extra = "model.layers.2.input_layernorm.weight"  # a third layer the config does not have

    def change(tensors):
        tensors[extra] = np.zeros(32, np.float32)

    _rewrite(folder, change)
    _raises(CheckpointError, folder, extra, "does not use")


def test_unsupported_tensor_dtype(ckpt):
    folder = ckpt()

    def change(tensors):
        tensors[NORM] = tensors[NORM].astype(np.int32)

    _rewrite(folder, change)
    _raises(CheckpointError, folder, NORM, "I32")


def test_untied_config_without_lm_head(ckpt):
    """transformers would load this with a random lm_head (missing_keys); we refuse."""
    folder = ckpt()
    _edit_config(folder, tie_word_embeddings=False)
    _raises(CheckpointError, folder, "lm_head.weight", "lacks")


def test_tied_config_with_equal_lm_head_loads(ckpt):
    folder = ckpt()
    reference = load_pretrained(folder)

    def change(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    _rewrite(folder, change)
    ids = sample_ids(1, 7)
    assert max_abs_diff(load_pretrained(folder)(ids).logits, reference(ids).logits) == 0.0


def test_tied_config_with_different_lm_head(ckpt):
    """Only the last vocabulary row differs; the block-wise comparison must still see it."""
    folder = ckpt()

    def change(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["lm_head.weight"][-1, 0] += 1.0

    _rewrite(folder, change)
    _raises(CheckpointError, folder, "lm_head.weight", "tie_word_embeddings")
    weight_map = checkpoint_weight_map(folder)
    names, _ = canonical_names(weight_map)
    with pytest.raises(CheckpointError, match="differs from the embedding"):
        _check_tied_head(folder, weight_map, names, rows_per_read=10)


def test_unknown_model_type(ckpt):
    folder = ckpt()
    _edit_config(folder, model_type="falcon")
    _raises(ConfigError, folder, "config.json", "'falcon'", "'llama'")  # the error lists what is supported


def test_heads_not_multiple_of_kv_heads(ckpt):
    folder = ckpt()
    _edit_config(folder, num_attention_heads=4, num_key_value_heads=3)
    _raises(ConfigError, folder, "num_attention_heads=4", "num_key_value_heads=3")


def test_layer_types_length_mismatch(ckpt):
    folder = ckpt()
    _edit_config(folder, layer_types=["sliding_attention"] * 3)
    _raises(ConfigError, folder, "layer_types", "num_hidden_layers is 2")


def test_unsupported_activation_and_rope(ckpt):
    folder = ckpt()
    _edit_config(folder, hidden_activation="gelu")  # exact GELU: transformers would use it for Gemma 2
    _raises(ConfigError, folder, "hidden_activation", "'gelu'")
    _edit_config(folder, hidden_activation="gelu_pytorch_tanh",
                 rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    _raises(ConfigError, folder, "'yarn'")


def test_missing_and_invalid_config(ckpt):
    folder = ckpt()
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        f.write("{not json")
    _raises(ConfigError, folder, path, "not valid JSON")
    os.remove(path)
    _raises(ConfigError, folder, path, "not found")


def test_index_points_at_missing_file(ckpt):
    folder = ckpt("sharded")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    os.remove(os.path.join(folder, files[1]))
    _raises(CheckpointError, folder, INDEX_FILE, files[1])


def test_index_claims_a_tensor_its_file_lacks(ckpt):
    folder = ckpt("sharded")
    index_path = os.path.join(folder, INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    embed_file = index["weight_map"]["model.embed_tokens.weight"]
    other = next(v for v in index["weight_map"].values() if v != embed_file)
    index["weight_map"]["model.embed_tokens.weight"] = other
    with open(index_path, "w") as f:
        json.dump(index, f)
    _raises(CheckpointError, folder, other, "model.embed_tokens.weight")


def test_invalid_index(ckpt):
    folder = ckpt("sharded")
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}}, f)
    _raises(CheckpointError, folder, INDEX_FILE, "weight_map")


def test_folder_without_weights(ckpt):
    folder = ckpt()
    os.remove(os.path.join(folder, "model.safetensors"))
    _raises(CheckpointError, folder, "model.safetensors")


def test_source_that_is_neither_folder_nor_repo_id(tmp_path):
    """A missing local path (not a valid repo id) must not turn into a Hub request."""
    with pytest.raises(CheckpointError, match="neither a local folder nor a valid Hub repo id"):
        load_pretrained(str(tmp_path / "does" / "not" / "exist"))
    file_path = tmp_path / "model.safetensors"
    file_path.write_bytes(b"12345678")
    with pytest.raises(CheckpointError, match="is a file"):
        load_pretrained(file_path)


def test_config_defaults_match_transformers_for_sparse_multimodal_config():
    """The gemma-3-4b config on the Hub lists only what differs from the class defaults."""
    import transformers

    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelConfig.from_hf_dict(sparse)
    theirs = transformers.Gemma3Config(**sparse).text_config
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "query_pre_attn_scalar", "sliding_window", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert list(ours.layer_types) == theirs.layer_types
    rope = theirs.rope_parameters
    assert ours.rope["full_attention"].theta == rope["full_attention"]["rope_theta"] == 1e6
    assert ours.rope["full_attention"].linear_factor == rope["full_attention"]["factor"] == 8.0
    assert ours.rope["sliding_attention"].theta == rope["sliding_attention"]["rope_theta"]
    gemma2 = ModelConfig.from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 2})
    reference = transformers.Gemma2Config(num_hidden_layers=2)
    assert (gemma2.final_logit_softcapping, gemma2.attn_logit_softcapping, gemma2.query_pre_attn_scalar) == \
        (reference.final_logit_softcapping, reference.attn_logit_softcapping, reference.query_pre_attn_scalar)


# ================================================================================================ the table
# Every row: what is broken, the error class, and the culprits the message must name (file, tensor, field,
# pattern or flag). The test also checks that the failed call wrote nothing (the working folder is unchanged).
SPEC = dict(num_layers=1, hidden_size=24, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def world(good, tmp_path_factory):
    """What the rows share: the good teacher loaded, a data-free plan for it, and another teacher of the same
    shapes with other weights (same config, seed 4)."""
    from nnx_surgery.surgery.planning.student_planner import plan_student
    from nnx_surgery.surgery.plans.student_spec import StudentSpec

    other = tmp_path_factory.mktemp("other")
    make_hf_model("gemma2", seed=4, num_hidden_layers=2, layer_types=None).save_pretrained(other)
    plan = plan_student(str(good / "single"), StudentSpec(**SPEC), depth="uniform", width="magnitude")
    return {"good": good, "teacher": load_pretrained(good / "single"), "plan": plan, "other": str(other)}


# ------------------------------------------------------------------------------------------------ checkpoints
def _header_far_beyond_file(w, ckpt, tmp):
    folder = ckpt()
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b'{"a":')  # a 1 TB header in a 13-byte file: never allocated
    return lambda: load_pretrained(folder), (path, "header length 1099511627776")


def _break_tensor(change, **load):
    def make(w, ckpt, tmp):
        folder = ckpt()
        _rewrite(folder, change)
        return lambda: load_pretrained(folder, **load), ()
    return make


def _set(name, index, value, dtype=None):
    def change(tensors):
        if dtype is not None:
            tensors[name] = tensors[name].astype(dtype)
        tensors[name].reshape(-1)[index] = value
    return change


def _index_entry(target):
    """The sharded checkpoint with the embedding's shard named by `target(folder, tmp, shard)`."""
    def make(w, ckpt, tmp):
        folder = ckpt("sharded")
        index_path = os.path.join(folder, INDEX_FILE)
        with open(index_path) as f:
            index = json.load(f)
        shard = index["weight_map"]["model.embed_tokens.weight"]
        outside = tmp / "elsewhere"
        outside.mkdir()
        shutil.copy(os.path.join(folder, shard), outside / "elsewhere.safetensors")  # a real file to lure to
        name = target(folder, outside, shard)
        index["weight_map"]["model.embed_tokens.weight"] = name
        with open(index_path, "w") as f:
            json.dump(index, f)
        return lambda: load_pretrained(folder), (INDEX_FILE, "model.embed_tokens.weight", name)
    return make


def _symlinked_shard(w, ckpt, tmp):
    folder = ckpt("sharded")
    with open(os.path.join(folder, INDEX_FILE)) as f:
        shard = json.load(f)["weight_map"]["model.embed_tokens.weight"]
    outside = tmp / "elsewhere.safetensors"
    shutil.move(os.path.join(folder, shard), outside)
    os.symlink(outside, os.path.join(folder, shard))
    return lambda: load_pretrained(folder), (shard, "link", str(outside))


def _symlinked_single_file(w, ckpt, tmp):
    folder = ckpt()
    outside = tmp / "weights.safetensors"
    shutil.move(os.path.join(folder, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(folder, "model.safetensors"))
    return lambda: load_pretrained(folder), ("model.safetensors", str(outside))


def _symlinked_tokenizer_on_save(w, ckpt, tmp):
    from nnx_surgery.surgery.storage.hf_checkpoint import save_pretrained

    folder = ckpt()
    secret = tmp / "secret.json"
    secret.write_text('{"private": true}')
    os.symlink(secret, os.path.join(folder, "tokenizer.json"))
    return lambda: save_pretrained(w["teacher"], tmp / "out", source=folder), ("tokenizer.json", str(secret))


def _config(culprits, **changes):
    def make(w, ckpt, tmp):
        folder = ckpt()
        _edit_config(folder, **changes)
        return lambda: load_pretrained(folder), culprits
    return make


# ------------------------------------------------------------------------------------------------ specs
def _spec(**changes):
    def make(w, ckpt, tmp):
        from nnx_surgery.surgery.plans.student_spec import StudentSpec
        return lambda: StudentSpec(**{**SPEC, **changes}), tuple(f"{k}={v!r}" for k, v in changes.items())
    return make


def _spec_against(culprits, kv_mode="auto", **changes):
    def make(w, ckpt, tmp):
        from nnx_surgery.surgery.plans.student_spec import StudentSpec
        return lambda: StudentSpec(**{**SPEC, **changes}).check_against(w["teacher"].config, kv_mode), culprits
    return make


def _call(fn, *culprits):
    return lambda w, ckpt, tmp: (lambda: fn(w, tmp), culprits)


def _named_shape_other_head_dim(w, tmp):
    from nnx_surgery.surgery.plans.student_spec import StudentSpec

    big = ModelConfig.from_hf_dict({"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640,
                                    "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
                                    "head_dim": 160, "vocab_size": 96})
    return StudentSpec.named("gemma-3-270m").check_against(big)


def _plan_student(**kwargs):
    def fn(w, tmp):
        from nnx_surgery.surgery.planning.student_planner import plan_student
        from nnx_surgery.surgery.plans.student_spec import StudentSpec
        return plan_student(w["teacher"], StudentSpec(**SPEC), **kwargs)
    return fn


# ------------------------------------------------------------------------------------------------ plans
def _edited_plan(edit, culprits):
    def make(w, ckpt, tmp):
        from nnx_surgery.surgery.plans.plan_record import Plan

        data = json.loads(w["plan"].to_json())
        edit(data)
        path = tmp / "plan.json"
        path.write_text(json.dumps(data))
        return lambda: Plan.load(path), (str(path),) + culprits
    return make


def _plan_file(content, culprits):
    def make(w, ckpt, tmp):
        from nnx_surgery.surgery.plans.plan_record import Plan

        path = tmp / "plan.json"
        if content is not None:
            path.write_text(content)
        return lambda: Plan.load(path), (str(path),) + culprits
    return make


def _other_teacher_in_memory(w, tmp):
    from nnx_surgery.surgery.pruning.in_memory import apply_plan
    return apply_plan(load_pretrained(w["other"]), w["plan"])


def _other_teacher_on_disk(w, tmp):
    from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint
    return prune_checkpoint(w["other"], w["plan"], tmp / "student")


def _plan_for_other_config(w, tmp):
    from nnx_surgery.surgery.pruning.in_memory import apply_plan
    from nnx_surgery.surgery.plans.plan_record import Plan

    data = json.loads(w["plan"].to_json())
    data["teacher"]["config"]["rms_norm_eps"] = 1e-5
    return apply_plan(w["teacher"], Plan.from_dict(data))


def _set_path(path, value):
    def edit(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return edit


# ------------------------------------------------------------------------------------------------ data
def _records(write, culprit_of):
    def make(w, ckpt, tmp):
        from nnx_surgery.distill.inputs.sources import read_records

        target = write(tmp)
        return lambda: read_records(target), culprit_of(target)
    return make


def _file(name, content):
    def write(tmp):
        path = tmp / name
        path.write_bytes(content)
        return str(path)
    return write


def _empty_folder(tmp):
    (tmp / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp / "corpus" / name).write_text("  \n")
    return str(tmp / "corpus")


def _rows_too_long(w, ckpt, tmp):
    from nnx_surgery.distill.inputs.batches import TokenBatches
    from nnx_surgery.distill.inputs.byte_tokenizer import byte_tokenizer

    source = f"max_position_embeddings in {w['good'] / 'single' / 'config.json'}"
    return (lambda: TokenBatches.from_records(["some text " * 40] * 4, byte_tokenizer(), seq_len=64, batch_size=1,
                                              max_positions=32, max_positions_source=source),
            ("seq_len 64", "32 positions", source))


def _foreign_tokenizer(vocab_size, *culprits):
    def make(w, ckpt, tmp):
        from nnx_surgery.distill.inputs.batches import check_vocabulary
        from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer

        folder = tmp / "tokenizer"
        save_byte_tokenizer(folder)  # 260 byte-level tokens
        return lambda: check_vocabulary(str(folder), vocab_size), (str(folder), "260 tokens", *culprits)
    return make


def _freeze_pattern(pattern):
    def make(w, ckpt, tmp):
        from nnx_surgery.distill.loop.freeze import check_patterns
        return lambda: check_patterns(w["teacher"], [pattern]), (repr(pattern), "100,000")
    return make


# ------------------------------------------------------------------------------------------------ meshes, outputs
def _mesh(fn, *culprits):
    return _call(lambda w, tmp: fn(), *culprits)


def _existing_output(save):
    def make(w, ckpt, tmp):
        out = tmp / "out"
        out.mkdir()
        (out / "notes.txt").write_text("an earlier result")
        return lambda: save(w, out), (str(out), "overwrite=True")
    return make


def _save_pretrained(w, out):
    from nnx_surgery.surgery.storage.hf_checkpoint import save_pretrained
    return save_pretrained(w["teacher"], out)


def _save_student(w, out):
    from nnx_surgery.surgery.pruning.in_memory import apply_plan, save_student
    return save_student(apply_plan(w["teacher"], w["plan"]), w["plan"], out)


def _prune(w, out):
    from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint
    return prune_checkpoint(str(w["good"] / "single"), w["plan"], out)


def _errors():
    from nnx_surgery.distill.mesh import MeshError
    from nnx_surgery.distill.inputs.sources import DataError
    from nnx_surgery.surgery.plans.plan_record import PlanError
    from nnx_surgery.surgery.plans.student_spec import SpecError
    return MeshError, DataError, PlanError, SpecError


MeshError, DataError, PlanError, SpecError = _errors()
Q0 = "model.layers.0.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"

CASES = {
    # checkpoints
    "header length far beyond the file": (CheckpointError, _header_far_beyond_file),
    "dtype we do not load (F64)": (CheckpointError, _break_tensor(lambda t: t.update({NORM: t[NORM].astype(
        np.float64)})), ),
    "mixed dtypes without dtype=": (CheckpointError, _break_tensor(lambda t: t.update({NORM: t[NORM].astype(
        np.float16)}))),
    "NaN weight, check_finite": (CheckpointError, _break_tensor(_set(NORM, 3, np.nan), check_finite=True)),
    "infinite weight, check_finite": (CheckpointError, _break_tensor(_set(Q0, 7, np.inf), check_finite=True)),
    "overflow when loaded as float16": (CheckpointError, _break_tensor(_set(EMBED, 5, 1e6), dtype="float16",
                                                                       check_finite=True)),
    "index entry with ..": (CheckpointError, _index_entry(lambda f, out, shard: "../elsewhere/elsewhere.safetensors")),
    "index entry absolute": (CheckpointError, _index_entry(lambda f, out, shard: str(out / "elsewhere.safetensors"))),
    "index entry through a linked folder": (CheckpointError, _index_entry(
        lambda f, out, shard: os.symlink(out, os.path.join(f, "sub")) or "sub/elsewhere.safetensors")),
    "shard is a symlink out of the folder": (CheckpointError, _symlinked_shard),
    "model.safetensors is a symlink out": (CheckpointError, _symlinked_single_file),
    "tokenizer.json is a symlink out (save)": (CheckpointError, _symlinked_tokenizer_on_save),
    "config without model_type": (ConfigError, _config(("model_type",), model_type=_DELETE)),
    "config vocab_size contradicts embedding": (CheckpointError, _config((EMBED, "[96, 32]", "[100, 32]"),
                                                                         vocab_size=100)),
    "config size that is not a number": (ConfigError, _config(("hidden_size", "'32'"), hidden_size="32")),
    "config negative head_dim": (ConfigError, _config(("head_dim=-12",), head_dim=-12)),
    "config sliding layers without window": (ConfigError, _config(("sliding_window",), sliding_window=0)),
    "config unknown layer type": (ConfigError, _config(("layer_types", "local"),
                                                       layer_types=["local", "full_attention"])),
    "config more KV heads than heads": (ConfigError, _config(("num_key_value_heads=8",), num_key_value_heads=8)),
    "config tie_word_embeddings not a bool": (ConfigError, _config(("tie_word_embeddings", "'yes'"),
                                                                   tie_word_embeddings="yes")),
    "config rope_scaling not an object": (ConfigError, _config(("RoPE", "'linear'"), rope_scaling="linear",
                                                               rope_parameters=None)),
    # specs
    "spec zero layers": (SpecError, _spec(num_layers=0)),
    "spec boolean size": (SpecError, _spec(hidden_size=True)),
    "spec heads not a multiple of KV heads": (SpecError, _spec(num_attention_heads=4, num_key_value_heads=3)),
    "spec unknown named shape": (SpecError, _call(lambda w, tmp: __import__("nnx_surgery.surgery.plans.student_spec").surgery.plans.student_spec.StudentSpec.named(
        "gemma-99b"), "'gemma-99b'")),
    "spec larger than the teacher": (SpecError, _spec_against(("num_layers=3", "num_hidden_layers=2"), num_layers=3)),
    "spec hidden not a multiple of heads": (SpecError, _spec_against(("hidden_size=30",), hidden_size=30,
                                                                     num_attention_heads=4, num_key_value_heads=2)),
    "spec unknown kv_mode": (SpecError, _spec_against(("kv_mode='bogus'",), kv_mode="bogus")),
    "spec select impossible": (SpecError, _spec_against(("kv_mode='select'", "4 query heads"), kv_mode="select",
                                                        num_attention_heads=4, hidden_size=24)),
    "spec unknown field": (SpecError, _call(lambda w, tmp: __import__("nnx_surgery.surgery.plans.student_spec").surgery.plans.student_spec.StudentSpec.from_dict(
        {**SPEC, "depth": 2}), "depth")),
    "spec scaling fraction above 1": (SpecError, _call(lambda w, tmp: __import__("nnx_surgery.surgery.plans.student_spec").surgery.plans.student_spec.StudentSpec
                                                       .scaled(w["teacher"].config, depth=1.5), "1.5")),
    "spec named shape with another head_dim": (SpecError, _call(_named_shape_other_head_dim, "head_dim 256",
                                                                "head_dim 160")),
    "plan_student unknown method": (SpecError, _call(_plan_student(depth="bogus"), "depth='bogus'")),
    "plan_student needs calibration": (SpecError, _call(_plan_student(depth="block_influence"), "calibration")),
    # plans
    "plan for another teacher (in memory)": (PlanError, _call(_other_teacher_in_memory, "fingerprint", EMBED)),
    "plan for another teacher (on disk)": (PlanError, _call(_other_teacher_on_disk, "fingerprint", EMBED)),
    "plan for another config": (PlanError, _call(_plan_for_other_config, "rms_norm_eps")),
    "plan index out of range": (PlanError, _edited_plan(_set_path(["kept_hidden", 0], 99), ("kept_hidden", "[99]"))),
    "plan duplicate index": (PlanError, _edited_plan(lambda d: d["kept_mlp"][0].__setitem__(1, d["kept_mlp"][0][0]),
                                                     ("kept_mlp", "more than once"))),
    "plan layer out of range": (PlanError, _edited_plan(_set_path(["kept_layers", 0], -1), ("kept_layers", "[-1]"))),
    "plan missing field": (PlanError, _edited_plan(_set_path(["kv_groups"], _DELETE), ("kv_groups",))),
    "plan field of the wrong type": (PlanError, _edited_plan(_set_path(["kept_heads"], "all"), ("kept_heads",))),
    "plan newer format": (PlanError, _edited_plan(_set_path(["format_version"], 99), ("format_version 99",))),
    "plan not JSON": (PlanError, _plan_file("{kept_layers: [0]", ("not valid JSON",))),
    "plan file missing": (PlanError, _plan_file(None, ("no such plan file",))),
    # data
    "data file missing": (DataError, _records(lambda tmp: str(tmp / "nope.txt"), lambda p: (p,))),
    "data file empty": (DataError, _records(_file("empty.txt", b""), lambda p: (p, "empty"))),
    "data not UTF-8": (DataError, _records(_file("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1")),
                                           lambda p: (p, "offset 3", "0xe9"))),
    "data folder with no text": (DataError, _records(_empty_folder, lambda p: (p, "no text"))),
    "data record without its field": (DataError, _records(_file("rows.jsonl", b'{"text": "a"}\n{"body": "b"}\n'),
                                                          lambda p: (f"{p}:2", "'text'"))),
    "data rows longer than the model supports": (DataError, _rows_too_long),
    "tokenizer with more tokens than the embedding": (DataError, _foreign_tokenizer(96, "96 rows",
                                                                                    "teacher's own tokenizer")),
    "tokenizer of a far bigger model's embedding": (DataError, _foreign_tokenizer(256000, "256,000 rows")),
    # freeze patterns
    "freeze brace range of 1e8 paths": (ValueError, _freeze_pattern("layers.{0-99999999}.mlp")),
    "freeze brace product over the cap": (ValueError, _freeze_pattern("layers.{0-999}.{0-999}")),
    # meshes (this process has one device; the 8-device cases are below)
    "mesh spec with a bad size": (MeshError, _mesh(lambda: __import__("nnx_surgery.distill.mesh").distill.mesh.parse_mesh_spec(
        "fsdp=two"), "'two'")),
    "mesh axis named twice": (MeshError, _mesh(lambda: __import__("nnx_surgery.distill.mesh").distill.mesh.parse_mesh_spec(
        "fsdp=1,fsdp=1"), "'fsdp' twice")),
    "mesh larger than the devices": (MeshError, _mesh(lambda: __import__("nnx_surgery.distill.mesh").distill.mesh.make_mesh("fsdp=4"),
                                                      "fsdp=4", "4 device(s)", "there are 1")),
    "config batch not split by the mesh": (MeshError, _mesh(lambda: __import__("nnx_surgery.distill.loop.run_config").distill.loop.run_config
                                                            .DistillConfig(mesh="fsdp=4", batch_size=6),
                                                            "batch_size=6", "multiple of 4")),
    "config mesh_devices not a count": (MeshError, _mesh(lambda: __import__("nnx_surgery.distill.loop.run_config").distill.loop.run_config
                                                         .DistillConfig(mesh="fsdp=1", mesh_devices=0),
                                                         "mesh_devices=0")),
    # outputs
    "save_pretrained over a non-empty folder": (CheckpointError, _existing_output(_save_pretrained)),
    "save_student over a non-empty folder": (CheckpointError, _existing_output(_save_student)),
    "prune_checkpoint over a non-empty folder": (CheckpointError, _existing_output(_prune)),
}
CULPRITS = {  # rows whose culprit needs the broken file's name: added here to keep the table readable
    "dtype we do not load (F64)": (NORM, "F64"),
    "mixed dtypes without dtype=": (NORM, "F16", "mixed", "dtype="),
    "NaN weight, check_finite": (NORM, "NaN"),
    "infinite weight, check_finite": (Q0, "infinite"),
    "overflow when loaded as float16": (EMBED, "float16"),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_table(case, world, ckpt, tmp_path):
    error, make = CASES[case]
    call, culprits = make(world, ckpt, tmp_path)
    before = tree(tmp_path)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for culprit in tuple(culprits) + CULPRITS.get(case, ()):
        assert culprit in message, f"{case}: {culprit!r} not named in {message!r}"
    assert info.value.__cause__ is None or isinstance(info.value.__cause__, error)
    assert tree(tmp_path) == before, f"{case}: the failed call wrote or changed files"


def test_table_is_large_enough():
    assert len(CASES) + len(MESH_CASES) >= 30


def test_mixed_dtypes_load_when_a_dtype_is_given(ckpt):
    folder = ckpt()
    reference = load_pretrained(folder)
    _rewrite(folder, lambda t: t.update({NORM: t[NORM].astype(np.float16)}))
    ids = sample_ids(1, 7)
    loaded = load_pretrained(folder, dtype="float32", check_finite=True)
    assert max_abs_diff(loaded(ids).logits, reference(ids).logits) < 1e-2  # one norm rounded to float16


# ------------------------------------------------------------------------------------------------ 8-device meshes
MESH_SCRIPT = r"""
import json, logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
import jax
from nnx_surgery.distill.mesh import MeshError, check_mesh_fits, make_mesh, put_batch
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model

assert jax.device_count() == 8
out = {}
def case(name, fn):
    try:
        fn()
        out[name] = ["ok", ""]
    except Exception as err:
        out[name] = [type(err).__name__, str(err)]

six_heads = ModelConfig.from_hf_dict({"model_type": "gemma2", "vocab_size": 64, "hidden_size": 48,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 1,
    "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4})
case("idle devices", lambda: make_mesh("fsdp=3,tp=1"))
case("subset asked for", lambda: make_mesh("fsdp=3,tp=1", devices=3))
case("devices= that does not match", lambda: make_mesh("fsdp=2,tp=2", devices=3))
case("tp not dividing the heads", lambda: check_mesh_fits(make_mesh("fsdp=2,tp=4"),
                                                           {"student": create_model(six_heads, seed=0)}))
case("tp over one KV head is fine", lambda: check_mesh_fits(make_mesh("fsdp=4,tp=2"),
                                                             {"student": create_model(six_heads, seed=0)}))
case("batch not split by the data axes", lambda: put_batch({"input_ids": np.zeros((6, 4), np.int32)},
                                                            make_mesh("fsdp=8")))
print("RESULT " + json.dumps(out))
"""
MESH_CASES = {  # name: (error class name or "ok", culprits)
    "idle devices": ("MeshError", ("fsdp=3,tp=1", "3 device(s)", "there are 8", "fsdp=8,tp=1", "fsdp=4,tp=2",
                                   "devices=3", "mesh_devices=3")),
    "devices= that does not match": ("MeshError", ("fsdp=2,tp=2", "devices= gives 3", "fsdp=3,tp=1")),
    "tp not dividing the heads": ("MeshError", ("tp=4", "self_attn", "dimension 6", "2, 3, 6")),
    "batch not split by the data axes": ("MeshError", ("batch 6", "fsdp", "multiple of 8")),
    "subset asked for": ("ok", ()),
    "tp over one KV head is fine": ("ok", ()),
}


@pytest.fixture(scope="module")
def mesh_results():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "XLA_FLAGS": with_host_devices(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout


@pytest.mark.parametrize("case", list(MESH_CASES))
def test_mesh_table(case, mesh_results):
    results, log = mesh_results
    kind, culprits = MESH_CASES[case]
    assert results[case][0] == kind, results[case]
    for culprit in culprits:
        assert culprit in results[case][1], f"{case}: {culprit!r} not named in {results[case][1]!r}"
    if case == "subset asked for":  # a subset on purpose is logged
        assert "LOG mesh fsdp=3,tp=1 runs on 3 of the 8 devices" in log


def test_the_teachers_own_tokenizer_and_rows_at_the_limit_pass(tmp_path):
    """The checks of the data rows above refuse only what is wrong: the teacher's own tokenizer, an embedding
    padded past it (Gemma 3 4B: 262,145 tokens, 262,208 rows) and rows exactly as long as the limit pass."""
    from nnx_surgery.distill.inputs.batches import TokenBatches, check_vocabulary
    from nnx_surgery.distill.inputs.byte_tokenizer import VOCAB_SIZE, byte_tokenizer, save_byte_tokenizer

    save_byte_tokenizer(tmp_path / "tok")
    assert check_vocabulary(str(tmp_path / "tok"), VOCAB_SIZE) == VOCAB_SIZE == 260
    assert check_vocabulary(str(tmp_path / "tok"), 320) == 260  # rows rounded up to a multiple of 64
    assert check_vocabulary(byte_tokenizer(), 260) == 260
    batches = TokenBatches.from_records(["some text " * 40] * 4, byte_tokenizer(), seq_len=32, batch_size=1,
                                        max_positions=32)
    assert batches.next_batch()["input_ids"].shape == (1, 32)
