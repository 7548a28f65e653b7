"""Students of every spec load cleanly in transformers with the NNX student's logits, and the on-disk surgery
writes exactly what the in-memory one does."""
import filecmp
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from hf_reference import (FAMILIES, assert_clean_loading, hf_logits, load_with_info, make_hf_model,  # noqa: E402
                          sample_ids, save_hf)

from nnx_surgery.surgery import ModelConfig, load_pretrained  # noqa: E402
from nnx_surgery.surgery.pruning.in_memory import apply_plan, save_student  # noqa: E402
from nnx_surgery.surgery.plans.plan_record import Plan  # noqa: E402
from nnx_surgery.surgery.planning.student_planner import plan_student  # noqa: E402
from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint  # noqa: E402
from nnx_surgery.surgery.plans.plan_report import format_report  # noqa: E402
from nnx_surgery.surgery.plans.student_spec import StudentSpec  # noqa: E402

IDS = sample_ids(batch=2, length=11)
CALIBRATION = np.random.default_rng(11).integers(0, 96, (8, 16))  # one batch: one compile

# (name, teacher KV heads, spec or callable(teacher config) -> spec, plan_student options)
CASES = [
    ("depth+width, select KV", 2, StudentSpec(3, 24, 32, 2, 1), dict(calibration=CALIBRATION)),
    ("GQA -> MQA merge, loss depth, untied head", 2, StudentSpec(3, 32, 40, 4, 1),
     dict(calibration=CALIBRATION, depth="loss", kv_merge="importance", untied=True)),
    ("7B:2B ratios on an MHA teacher", 4, StudentSpec.scaled_like, dict(calibration=CALIBRATION)),
    ("data-free from disk, bf16, sharded files", 4, StudentSpec(2, 20, 24, 2, 1), dict(bf16=True, report=True)),
]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    made = {}

    def get(family, kv, bf16=False, untied=False):
        key = (family, kv, bf16, untied)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"teacher-{family}-{kv}-{int(bf16)}-{int(untied)}")
            model = make_hf_model(family, seed=5, num_key_value_heads=kv, tie_word_embeddings=not untied)
            if bf16:
                model = model.to(torch.bfloat16)
            made[key] = save_hf(model, folder, max_shard_size="20KB" if bf16 else "50GB")
        return made[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_student_loads_in_transformers_and_disk_path_is_bit_exact(family, case, teachers, tmp_path):
    _, kv, spec, options = case
    options = dict(options)
    bf16, report, untied = (options.pop(key, False) for key in ("bf16", "report", "untied"))
    src = teachers(family, kv, bf16, untied)
    config = ModelConfig.from_file(src)
    spec = spec(config) if callable(spec) else spec
    # Without calibration the plan is scored from disk, tensor by tensor, without loading the teacher.
    plan = plan_student(src if bf16 else load_pretrained(src), spec, source=src, **options)
    assert Plan.from_json(plan.to_json()) == plan

    on_disk = prune_checkpoint(src, plan, tmp_path / "disk", max_shard_size="30KB" if bf16 else "5GB",
                               report=report)
    teacher = load_pretrained(src)
    student = apply_plan(teacher, plan)
    in_memory = save_student(student, plan, tmp_path / "memory", source=src,
                             max_shard_size="30KB" if bf16 else "5GB", report=report)
    names = sorted(os.listdir(on_disk))
    assert names == sorted(os.listdir(in_memory))
    assert "plan.json" in names and ("surgery_report.png" in names) == report
    _, mismatch, errors = filecmp.cmpfiles(on_disk, in_memory, names, shallow=False)
    assert not mismatch and not errors, mismatch
    assert Plan.load(on_disk) == plan

    hf_model, info = load_with_info(on_disk, dtype=torch.float32)
    assert_clean_loading(info)
    expected = ModelConfig.from_file(on_disk)
    assert hf_model.config.num_key_value_heads == spec.num_key_value_heads == expected.num_key_value_heads
    assert expected.layer_types == tuple(config.layer_types[i] for i in plan.kept_layers)
    assert expected.tie_word_embeddings is not untied
    nnx_student = load_pretrained(on_disk, dtype="float32")
    want = np.asarray(nnx_student(IDS).logits)
    np.testing.assert_allclose(hf_logits(hf_model, IDS), want, atol=1e-4, rtol=0)
    if not bf16:  # the in-memory student itself, not only its saved copy
        np.testing.assert_allclose(np.asarray(student(IDS).logits), want, atol=1e-6, rtol=0)


def test_calibration_plans_are_deterministic_and_round_trip(teachers, tmp_path):
    teacher = load_pretrained(teachers("gemma2", 2))
    spec = StudentSpec(3, 24, 32, 2, 1)
    pool = np.concatenate([CALIBRATION, CALIBRATION[:, ::-1]])  # 16 sequences, 8 drawn by the seed
    first = plan_student(teacher, spec, calibration=pool, num_samples=8, seed=3, depth="loss")
    again = plan_student(teacher, spec, calibration=list(pool.reshape(4, 4, 16)), num_samples=8, seed=3,
                         depth="loss")
    assert first == again
    assert first.calibration["sequences"] == 8 and first.calibration["seed"] == 3
    other = plan_student(teacher, spec, calibration=pool, num_samples=8, seed=4, depth="loss")
    assert other.calibration["sha256"] != first.calibration["sha256"]
    path = first.save(tmp_path)
    assert Plan.load(path) == first and Plan.from_json(first.to_json()) == first
    assert first.teacher["config"] == teacher.config.to_hf_dict()
    assert len(first.scores["mlp"]) == 4 and len(first.scores["mlp"][0]) == 48
    table = format_report(first)
    assert "block infl." in table and "kept per axis" in table and "parameters" in table


@pytest.mark.parametrize("family", FAMILIES)
def test_embedding_compensation_brings_the_student_closer(family, teachers):
    """Narrower hidden only: the compensated student starts closer to the teacher (KL on calibration data)."""
    teacher = load_pretrained(teachers(family, 2))
    plan = plan_student(teacher, StudentSpec(4, 16, 48, 4, 2), calibration=CALIBRATION, measure_compensation=True)
    effect = plan.scores["compensation"]
    assert effect["compensated"]["kl"] < effect["plain"]["kl"], effect
    assert plan.embed_scale == pytest.approx(np.sqrt(2)) and plan.final_norm_scale == pytest.approx(1 / np.sqrt(2))
    assert "KL(teacher || student)" in format_report(plan)
