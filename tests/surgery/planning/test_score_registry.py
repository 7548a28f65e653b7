"""An importance score registered by name is what the planner ranks by (the extension point for new scores)."""
import numpy as np
import pytest

from nnx_surgery.surgery import ModelConfig, create_model
from nnx_surgery.surgery.planning.importance import SCORES, Score, register_score
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec

CONFIG = ModelConfig.from_hf_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))


@pytest.fixture
def registered():
    """Two data-free scores: keep the last MLP neurons / hidden channels / heads, and the last layers."""
    def last_widths(inputs):
        c = inputs.config
        return {"mlp": np.tile(np.arange(c.intermediate_size, dtype=float), (c.num_hidden_layers, 1)),
                "heads": np.tile(np.arange(c.num_attention_heads, dtype=float), (c.num_hidden_layers, 1)),
                "hidden": np.arange(c.hidden_size, dtype=float)}

    def last_layers(inputs):
        return {"depth_order": np.arange(inputs.config.num_hidden_layers, dtype=float)}

    register_score(Score("last", "width", last_widths, needs_calibration=False))
    register_score(Score("last_layers", "depth", last_layers, needs_calibration=False, ranks_by="depth_order"))
    yield
    SCORES.pop("last"), SCORES.pop("last_layers")


def test_a_registered_score_drives_the_plan(registered):
    plan = plan_student(create_model(CONFIG), StudentSpec(2, 24, 32, 4, 2), depth="last_layers", width="last")
    assert plan.kept_layers == [2, 3] and plan.methods == {**plan.methods, "depth": "last_layers", "width": "last"}
    assert plan.kept_hidden == list(range(8, 32)) and plan.kept_mlp == [list(range(16, 48))] * 2
    assert plan.scores["depth_order"] == [0.0, 1.0, 2.0, 3.0]


def test_unknown_scores_are_refused_with_the_registered_names(registered):
    with pytest.raises(SpecError, match="last_layers"):
        plan_student(create_model(CONFIG), StudentSpec(2, 24, 32, 4, 2), depth="nope")
    with pytest.raises(ValueError, match="ranks_by"):
        register_score(Score("bad", "depth", lambda inputs: {}, needs_calibration=False))


def test_plans_from_one_scoring_of_the_teacher_equal_plans_that_measure_it(monkeypatch):
    """score_teacher measures the teacher once (one set of calibration passes for any number of shapes) and
    plan_student(scored=) gives the plans it gives when it measures; other calibration rows are refused."""
    from nnx_surgery.surgery.planning import student_planner
    teacher = create_model(CONFIG, seed=3)
    calibration = np.random.default_rng(0).integers(0, 64, size=(6, 12))
    shapes = [StudentSpec(3, 24, 32, 4, 2), StudentSpec(2, 32, 24, 2, 1), StudentSpec(4, 16, 48, 4, 2)]
    measured = [plan_student(teacher, spec, calibration=calibration, seed=1) for spec in shapes]
    passes = []
    original = student_planner._scores
    monkeypatch.setattr(student_planner, "_scores", lambda *a: passes.append(1) or original(*a))
    scored = student_planner.score_teacher(teacher, calibration=calibration, seed=1)
    reused = [plan_student(teacher, spec, calibration=calibration, seed=1, scored=scored) for spec in shapes]
    assert len(passes) == 1 and scored.depth == "block_influence" and scored.width == "activation"
    assert [p.to_dict() for p in reused] == [p.to_dict() for p in measured]
    with pytest.raises(ValueError, match="call score_teacher with the plan's calibration"):
        plan_student(teacher, shapes[0], calibration=calibration[:4], seed=1, scored=scored)
    with pytest.raises(ValueError, match="width 'magnitude'"):
        plan_student(teacher, shapes[0], calibration=calibration, seed=1, width="magnitude", scored=scored)
