"""Surgery that removes only dead parts of a teacher must leave its logits unchanged.

Each case zeroes something in a tiny transformers-made teacher (loaded into NNX), lets `plan_student` find it with
its own scores, and checks that the student computes the teacher's logits (float32, <= 1e-5 relative). Gemma 1/2/3
and the Llama family (Llama; Qwen2 with its q/k/v biases) go through the same cases.
"""
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from hf_reference import FAMILIES, make_hf_model, sample_ids, save_hf  # noqa: E402

from nnx_surgery.surgery import load_pretrained  # noqa: E402
from nnx_surgery.surgery.pruning.in_memory import apply_plan  # noqa: E402
from nnx_surgery.surgery.planning.student_planner import plan_student  # noqa: E402
from nnx_surgery.surgery.plans.student_spec import StudentSpec  # noqa: E402

IDS = sample_ids(batch=2, length=13)
CALIBRATION = np.random.default_rng(7).integers(0, 96, (8, 16))


@pytest.fixture(scope="module", params=FAMILIES + ("llama", "qwen2"))
def teacher_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"teacher-{request.param}")
    return save_hf(make_hf_model(request.param, seed=3), folder)


def _zero(param, index):
    param[...] = param[...].at[index].set(0.0)


def _assert_same_logits(teacher, student):
    want = np.asarray(teacher(IDS).logits)
    got = np.asarray(student(IDS).logits)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_dead_mlp_neurons(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    dead = np.arange(0, 48, 3)  # 16 of 48 neurons whose down-projection columns are zero
    for layer in teacher.layers:
        _zero(layer.mlp.down_proj.weight, (slice(None), dead))  # (D, F), as HF: column f reads neuron f
    plan = plan_student(teacher, StudentSpec(4, 32, 32, 4, 2), width="magnitude")
    assert all(set(kept).isdisjoint(dead) for kept in plan.kept_mlp)
    _assert_same_logits(teacher, apply_plan(teacher, plan))


def test_dead_query_heads(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    for layer in teacher.layers:
        _zero(layer.self_attn.o_proj.weight, (slice(None), np.array([1, 2])))  # (D, N, H): heads 1, 2 write nothing
    plan = plan_student(teacher, StudentSpec(4, 32, 48, 2, 2), width="magnitude")
    assert plan.kept_heads == [[[0], [3]]] * 4  # one live head per KV group, each kept with its own group
    assert plan.kv_groups == [[[0], [1]]] * 4
    _assert_same_logits(teacher, apply_plan(teacher, plan))


def test_dead_layer_found_by_block_influence(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    layer = teacher.layers[2]
    _zero(layer.self_attn.o_proj.weight, slice(None))
    _zero(layer.mlp.down_proj.weight, slice(None))
    plan = plan_student(teacher, StudentSpec(3, 32, 48, 4, 2), calibration=CALIBRATION)
    assert plan.kept_layers == [0, 1, 3]
    assert plan.scores["block_influence"][2] < 1e-6 < min(plan.scores["block_influence"][i] for i in (0, 1, 3))
    assert plan.layer_types == [teacher.layers[i].attention_type for i in (0, 1, 3)]
    _assert_same_logits(teacher, apply_plan(teacher, plan))


def test_dead_layer_found_by_loss(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    _zero(teacher.layers[1].self_attn.o_proj.weight, slice(None))
    _zero(teacher.layers[1].mlp.down_proj.weight, slice(None))
    plan = plan_student(teacher, StudentSpec(3, 32, 48, 4, 2), calibration=CALIBRATION, depth="loss")
    assert abs(plan.scores["loss_increase"][1]) < 1e-5 < max(abs(v) for v in plan.scores["loss_increase"])
    explicit = plan_student(teacher, StudentSpec(3, 32, 48, 4, 2), layers=[0, 2, 3], width="magnitude")
    assert explicit.methods["depth"] == "explicit" and explicit.kept_layers == [0, 2, 3]
    _assert_same_logits(teacher, apply_plan(teacher, explicit))


def test_identical_kv_heads_merge_exactly(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    for layer in teacher.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):  # (K, H, D): KV head 1 := KV head 0
            proj.weight[...] = proj.weight[...].at[1].set(proj.weight[...][0])
            if hasattr(proj, "bias"):  # Qwen2: (K, H) biases too
                proj.bias[...] = proj.bias[...].at[1].set(proj.bias[...][0])
    plan = plan_student(teacher, StudentSpec(4, 32, 48, 4, 1), calibration=CALIBRATION)
    assert plan.methods["kv"] == "merge-mean" and plan.kv_groups == [[[0, 1]]] * 4
    assert plan.kept_heads == [[[0, 1, 2, 3]]] * 4
    _assert_same_logits(teacher, apply_plan(teacher, plan))


def test_dead_hidden_channels_with_compensation(teacher_dir):
    """Channels no tensor writes are always zero in the residual stream: removing them is exact once the
    embedding keeps its teacher scale and every norm is corrected for averaging over fewer channels."""
    teacher = load_pretrained(teacher_dir)
    dead = np.arange(0, 32, 4)  # 8 of 32 channels
    _zero(teacher.embed_tokens, (slice(None), dead))
    for layer in teacher.layers:
        _zero(layer.self_attn.o_proj.weight, dead)  # (D, N, H): rows are hidden channels
        _zero(layer.mlp.down_proj.weight, dead)
    spec = StudentSpec(4, 24, 48, 4, 2)
    plan = plan_student(teacher, spec, calibration=CALIBRATION, norm_correction=True)
    assert set(plan.kept_hidden).isdisjoint(dead)
    # Gemma multiplies embeddings by sqrt(hidden): the kept columns are scaled back up; Llama does not
    assert plan.embed_scale == pytest.approx(np.sqrt(32 / 24) if teacher.config.scales_embeddings else 1.0)
    _assert_same_logits(teacher, apply_plan(teacher, plan))
    plain = apply_plan(teacher, plan.without_compensation())
    assert np.abs(np.asarray(plain(IDS).logits) - np.asarray(teacher(IDS).logits)).max() > 1e-2


def test_teacher_is_not_modified(teacher_dir):
    teacher = load_pretrained(teacher_dir)
    before = np.asarray(teacher.embed_tokens[...]).copy()
    plan = plan_student(teacher, StudentSpec(2, 24, 32, 2, 1), width="magnitude")
    student = apply_plan(teacher, plan)
    assert np.array_equal(np.asarray(teacher.embed_tokens[...]), before)
    assert student.embed_tokens[...].shape == (96, 24) and len(teacher.layers) == 4
    assert student.embed_tokens[...].dtype == jnp.float32
