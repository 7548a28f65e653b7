"""Specs and plans that cannot work are refused up front, with an error that names the constraint and the fix."""
import dataclasses

import numpy as np
import pytest

from nnx_surgery.surgery import ModelConfig, create_model, save_pretrained
from nnx_surgery.surgery.pruning.in_memory import apply_plan
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint
from nnx_surgery.surgery.plans.student_spec import NAMED_SHAPES, SpecError, StudentSpec


def config(model_type="gemma2", **changes) -> ModelConfig:
    base = {"model_type": model_type, "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
            "query_pre_attn_scalar": 8, "sliding_window": 4}
    return ModelConfig.from_hf_dict({**base, **changes})


def real_shape(name: str, model_type: str = "gemma") -> ModelConfig:
    layers, hidden, inter, heads, kv, head_dim = NAMED_SHAPES[name]
    return config(model_type, vocab_size=256000, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)


@pytest.mark.parametrize("sizes, message", [
    ((4, 48, 64, 6, 4), "not a multiple of num_key_value_heads"),
    ((0, 48, 64, 8, 4), "must be a positive integer"),
    ((4, 48.0, 64, 8, 4), "must be a positive integer"),
])
def test_spec_alone(sizes, message):
    with pytest.raises(SpecError, match=message):
        StudentSpec(*sizes)


@pytest.mark.parametrize("teacher, sizes, kv_mode, message", [
    (config(), (5, 48, 64, 8, 4), "auto", "num_layers=5 is larger than the teacher's num_hidden_layers=4"),
    (config(), (4, 48, 80, 8, 4), "auto", "intermediate_size=80 is larger"),
    (config(), (4, 44, 64, 8, 4), "auto", "hidden_size=44 is not a multiple of num_attention_heads=8.*Use "
                                          "hidden_size=40 or 48"),
    (config(num_attention_heads=6, num_key_value_heads=3), (4, 48, 64, 6, 2), "auto",
     "cannot be formed from whole teacher KV groups.*num_key_value_heads in \\(1, 3\\)"),
    (config(), (4, 48, 64, 8, 1), "select", "kv_mode='select'.*at most 2 query heads"),
    (config(num_attention_heads=6, num_key_value_heads=3), (4, 48, 64, 4, 2), "merge",
     "3 teacher KV heads do not split into 2"),
    (config(), (4, 48, 64, 8, 4), "sideways", "kv_mode='sideways'"),
])
def test_spec_against_teacher(teacher, sizes, kv_mode, message):
    with pytest.raises(SpecError, match=message):
        StudentSpec(*sizes).check_against(teacher, kv_mode)


def test_hidden_multiple_of_heads_rule_is_transformers_own():
    """The families' `hidden_multiple_of_heads` list exactly the supported model types whose transformers config
    refuses a hidden_size that is not a multiple of the heads (head_dim explicit)."""
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import CONFIG_MAPPING

    from nnx_surgery.surgery.modeling.model_config import SUPPORTED_MODEL_TYPES
    from nnx_surgery.surgery.families import FAMILIES

    refused = set()
    for model_type in SUPPORTED_MODEL_TYPES:
        try:
            CONFIG_MAPPING[model_type](hidden_size=44, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                                       intermediate_size=64, num_hidden_layers=2, vocab_size=64)
        except (ValueError, StrictDataclassClassValidationError):
            refused.add(model_type)
    assert refused == {t for family in FAMILIES for t in family.hidden_multiple_of_heads}
    assert "gemma2" in refused and "gemma" not in refused


def test_gemma1_allows_hidden_not_multiple_of_heads_and_kv_formation():
    assert StudentSpec(4, 44, 64, 8, 4).check_against(config("gemma")) == "select"
    assert StudentSpec(4, 48, 64, 8, 1).check_against(config()) == "merge"
    assert StudentSpec(4, 48, 64, 4, 2).check_against(config()) == "select"


def test_named_shapes_and_the_7b_to_2b_ratios():
    spec = StudentSpec.named("google/gemma-2b")
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
            spec.num_key_value_heads) == (18, 2048, 16384, 8, 1)
    seven_b = real_shape("gemma-7b")
    assert spec.check_against(seven_b) == "merge"  # 16 KV heads -> 1: multi-head to multi-query
    assert dataclasses.replace(StudentSpec.scaled_like(seven_b), name="gemma-2b") == spec
    for name in ("gemma-2-2b", "gemma-3-1b", "gemma-3-270m"):
        StudentSpec.named(name).check_against(real_shape("gemma-2-9b", "gemma2"))
    with pytest.raises(SpecError, match="no named student shape 'gemma-5b'"):
        StudentSpec.named("gemma-5b")
    with pytest.raises(SpecError, match="head_dim 256, but a student keeps the teacher's head_dim 8"):
        StudentSpec.named("gemma-3-270m").check_against(config(hidden_size=1024, intermediate_size=8192,
                                                               num_hidden_layers=20))


def test_scaled_specs_are_always_valid():
    for teacher in (config(), config("gemma3_text", num_key_value_heads=8), config("gemma", num_key_value_heads=1)):
        for fraction in (0.1, 0.3, 0.5, 0.77, 1.0):
            spec = StudentSpec.scaled(teacher, depth=fraction, hidden=fraction, intermediate=fraction,
                                      heads=fraction, kv_heads=fraction)
            spec.check_against(teacher)


@pytest.fixture(scope="module")
def teacher():
    return create_model(config(), seed=0)


def _plan(teacher, **kw):
    return plan_student(teacher, StudentSpec(3, 32, 48, 4, 2), width="magnitude", **kw)


def test_plan_for_another_teacher_is_refused(teacher, tmp_path):
    plan = _plan(teacher)
    other = create_model(config(intermediate_size=96), seed=0)
    with pytest.raises(PlanError, match="intermediate_size: plan 64 vs teacher 96.*plan_student"):
        apply_plan(other, plan)
    folder = save_pretrained(other, tmp_path / "other")
    with pytest.raises(PlanError, match="different teacher.*intermediate_size"):
        prune_checkpoint(folder, plan, tmp_path / "student")
    assert not (tmp_path / "student").exists()


@pytest.mark.parametrize("field, value, message", [
    ("kept_hidden", lambda p: p.kept_hidden[:-1] + p.kept_hidden[:1], "appear more than once"),
    ("kept_hidden", lambda p: p.kept_hidden[:-1], "needs exactly 32"),
    ("kept_mlp", lambda p: [m[:-1] + [999] for m in p.kept_mlp], "outside the teacher's range"),
    ("kept_heads", lambda p: [p.kept_heads[0][::-1]] + p.kept_heads[1:],  # each KV head gets the other's
     "must be 2 teacher query heads from the groups"),
    ("layer_types", lambda p: ["full_attention"] * 3, "attention types"),
    ("kv_weights", lambda p: [[[0.0], [1.0]]] * 3, "positive weight"),
])
def test_inconsistent_plans_are_refused(teacher, field, value, message):
    plan = _plan(teacher)
    data = plan.to_dict()
    data[field] = value(plan)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


@pytest.mark.parametrize("options, message", [
    (dict(layers=[0, 1]), "layers: 2 indices given, the spec needs exactly 3"),
    (dict(layers=[3, 1, 0]), "increasing order"),
    (dict(hidden=list(range(31)) + [99]), "in \\[0, 48\\)"),
    (dict(heads=[0, 2, 4, 6]), "query heads \\[0, 2\\].*belong to teacher KV heads \\[0, 1\\]"),
    (dict(kv_groups=[[0], [1]], heads=[0, 1, 4, 5]), "student KV head 1 is formed from teacher KV heads \\[1\\]"),
    (dict(depth="magic"), "choose depth from"),
])
def test_bad_explicit_choices(teacher, options, message):
    with pytest.raises(SpecError, match=message):
        _plan(teacher, **options)


def test_explicit_choices_are_kept(teacher):
    plan = _plan(teacher, layers=[0, 2, 3], hidden=list(range(16, 48)), mlp=list(range(48)),
                 heads=[4, 5, 0, 1], kv_groups=[[2], [0]])
    assert plan.kept_layers == [0, 2, 3] and plan.kept_hidden == list(range(16, 48))
    assert plan.kept_heads[0] == [[4, 5], [0, 1]] and plan.kv_groups[0] == [[2], [0]]
    assert plan.flat_heads(1) == [4, 5, 0, 1]


def test_calibration_and_data_requirements(teacher):
    spec = StudentSpec(3, 32, 48, 4, 2)
    with pytest.raises(SpecError, match="need calibration token ids"):
        plan_student(teacher, spec, width="activation")
    with pytest.raises(ValueError, match="outside the teacher's vocabulary"):
        plan_student(teacher, spec, calibration=np.full((2, 8), 64))
    with pytest.raises(ValueError, match="integer token ids"):
        plan_student(teacher, spec, calibration=np.zeros((2, 8)))
    with pytest.raises(SpecError, match="norm_correction=True measures"):
        plan_student(teacher, spec, width="magnitude", norm_correction=True)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="newer than this toolkit"):
        Plan.from_dict({**_plan(teacher).to_dict(), "format_version": 99})
