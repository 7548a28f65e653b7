"""Narrowing the hidden size: the embedding compensation only where the family scales embeddings by sqrt(D), the
norm-energy correction for every family, and the student's tensors carry exactly the planned factors."""
import math

import numpy as np
import pytest

from nnx_surgery.surgery import ModelConfig, create_model
from nnx_surgery.surgery.pruning.in_memory import apply_plan
from nnx_surgery.surgery.planning.importance import activation_stats, calibration_batches
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.storage.tensor_readers import MemoryReader
from nnx_surgery.surgery.plans.student_spec import StudentSpec

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
EXTRA = {"gemma2": {"query_pre_attn_scalar": 8, "sliding_window": 4}, "llama": {}}
SPEC = StudentSpec(1, 24, 32, 2, 1)
CALIBRATION = np.random.default_rng(4).integers(0, 64, (4, 8))
C = math.sqrt(32 / 24)  # teacher / student hidden size


def teacher(model_type: str, tied: bool):
    config = ModelConfig.from_hf_dict({"model_type": model_type, **SIZES, **EXTRA[model_type],
                                       "tie_word_embeddings": tied})
    return create_model(config, seed=2)


def effective(norm_weight: np.ndarray, config) -> np.ndarray:
    """The factor an RMSNorm multiplies by: (1 + w) where the family stores w that way (Gemma), else w."""
    return 1.0 + norm_weight if config.norm_offset else norm_weight


@pytest.mark.parametrize("model_type, tied", [("gemma2", True), ("gemma2", False), ("llama", True),
                                              ("llama", False)])
def test_compensation_follows_the_family(model_type, tied):
    model = teacher(model_type, tied)
    scales = model.config.scales_embeddings
    assert scales == (model_type == "gemma2")
    plain = plan_student(model, SPEC, calibration=CALIBRATION)
    corrected = plan_student(model, SPEC, calibration=CALIBRATION, norm_correction=True)

    assert plain.embed_scale == corrected.embed_scale == pytest.approx(C if scales else 1.0, rel=1e-8)
    fold = C if scales and tied else 1.0  # the tied head is the scaled embedding: 1/c goes into the final norm
    assert plain.final_norm_scale == pytest.approx(1 / fold, rel=1e-8)
    assert plain.methods["compensation"] == ("embedding" if scales else "none")
    assert corrected.methods["compensation"] == ("embedding+norms" if scales else "norms")
    if not scales:
        assert plain.norm_scales == {}

    energy = activation_stats(model, calibration_batches(CALIBRATION, 8, None, 0)).norm_energy
    kept = np.asarray(corrected.kept_hidden)
    ratio = 32 / 24
    want_final = math.sqrt(ratio * float(np.asarray(energy["final"])[kept].sum())) / fold
    assert corrected.final_norm_scale == pytest.approx(want_final, rel=1e-7)
    assert corrected.final_norm_scale != pytest.approx(plain.final_norm_scale, rel=1e-4)
    t = corrected.kept_layers[0]
    for name, factor in corrected.norm_scales["layers"][0].items():
        assert factor == pytest.approx(math.sqrt(ratio * float(np.asarray(energy[name][t])[kept].sum())), rel=1e-7)


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_student_tensors_carry_the_planned_factors(model_type):
    model = teacher(model_type, tied=True)
    plan = plan_student(model, SPEC, calibration=CALIBRATION, norm_correction=True)
    teacher_read, student_read = MemoryReader(model), MemoryReader(apply_plan(model, plan))
    kept = np.asarray(plan.kept_hidden)
    embed = teacher_read("model.embed_tokens.weight", None, kept)
    np.testing.assert_allclose(student_read("model.embed_tokens.weight", None, None), embed * plan.embed_scale,
                               rtol=1e-6)
    config = model.config
    final = effective(teacher_read("model.norm.weight", kept, None), config) * plan.final_norm_scale
    np.testing.assert_allclose(effective(student_read("model.norm.weight", None, None), config), final, rtol=1e-5)
    t = plan.kept_layers[0]
    for name, factor in plan.norm_scales["layers"][0].items():
        want = effective(teacher_read(f"model.layers.{t}.{name}.weight", kept, None), config) * factor
        np.testing.assert_allclose(effective(student_read(f"model.layers.0.{name}.weight", None, None), config),
                                   want, rtol=1e-5, err_msg=name)
