"""Configuration: schedules, stages, validation, mesh specs and the teacher -> student correspondence."""
import math
import types

import pytest

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Ramp, Stage
from nnx_surgery.distill.interface import Correspondence, correspondence_from_plan
from nnx_surgery.distill.mesh import parse_mesh_spec
from nnx_surgery.distill.loop.trainer import resolve_correspondence


def test_learning_rate_warms_up_then_follows_a_cosine_to_the_floor():
    stage = Stage(steps=12, learning_rate=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert [stage.learning_rate_at(i) for i in (0, 1)] == [0.5, 1.0]
    assert stage.learning_rate_at(2) == pytest.approx(1.0)
    assert stage.learning_rate_at(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert stage.learning_rate_at(12) == pytest.approx(0.1)


def test_learning_rate_schedule_equals_the_warmup_cosine_formula():
    """optax's schedule gives the values of the formula it replaced (float32 rounding apart)."""
    def formula(stage, step):
        if step < stage.warmup_steps:
            return stage.learning_rate * (step + 1) / stage.warmup_steps
        fraction = min(1.0, (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return stage.learning_rate * (stage.min_lr_ratio + (1.0 - stage.min_lr_ratio) * cosine)

    for stage in (Stage(steps=12, learning_rate=3e-4, warmup_steps=3, min_lr_ratio=0.1),
                  Stage(steps=5, learning_rate=1e-2, min_lr_ratio=1.0), Stage(steps=1, learning_rate=0.5),
                  Stage(steps=4, learning_rate=2.0, warmup_steps=4, min_lr_ratio=0.0)):
        for step in range(stage.steps + 1):
            assert stage.learning_rate_at(step) == pytest.approx(formula(stage, step), rel=1e-6, abs=1e-12)


def test_temperature_schedule_and_ramps():
    stage = Stage(steps=5, temperature=(3.0, 1.0))
    assert [stage.temperature_at(i) for i in range(5)] == [3.0, 2.5, 2.0, 1.5, 1.0]
    assert Stage(steps=3, temperature=2.0).temperature_at(2) == 2.0
    assert Ramp(0.0, 1.0, "cosine").at(0.5) == pytest.approx(0.5) and Ramp(0.0, 1.0, "cosine").at(0.25) < 0.25


def test_loss_weights_and_alpha_mixing():
    assert LossWeights.mixed(0.7).as_dict() == pytest.approx(LossWeights(kl=0.7, ce=0.3).as_dict())
    assert LossWeights.mixed(0.5, "jsd", attention=0.1).active() == {"jsd", "ce", "attention"}
    with pytest.raises(ValueError, match="alpha"):
        LossWeights.mixed(1.5)
    with pytest.raises(ValueError, match="every loss weight is 0"):
        Stage(steps=1, weights=LossWeights(kl=0.0))


def test_config_stages_validation_and_from_dict():
    config = DistillConfig.from_dict({
        "stages": [{"steps": 3, "trainable": ["layers.{6-9}"], "weights": {"kl": 1.0}},
                   {"steps": 2, "learning_rate": 1e-5, "weights": {"kl": 0.5, "ce": 0.5}, "temperature": [2, 1]}],
        "optimizer": {"weight_decay": 0.01, "clip_norm": None}, "guard": {"max_rollbacks": 1},
        "mesh": "fsdp=4,tp=2"})
    assert config.total_steps == 5 and config.optimizer.clip_norm is None and config.guard.max_rollbacks == 1
    assert [config.stage_at(i) for i in (0, 2, 3, 4)] == [(0, 0), (0, 2), (1, 0), (1, 1)]
    assert config.stages[1].temperature == Ramp(2.0, 1.0) and not config.unit_temperature
    with pytest.raises(ValueError, match="unknown keys"):
        DistillConfig.from_dict({"stpes": []})
    with pytest.raises(ValueError, match="top_k cannot be combined"):
        DistillConfig(stages=(Stage(steps=1, weights=LossWeights(reverse_kl=1.0)),), top_k=8)
    with pytest.raises(ValueError, match="compute_dtype"):
        DistillConfig(compute_dtype="float16")


def test_mesh_spec_parsing():
    assert parse_mesh_spec("fsdp=4,tp=2") == {"fsdp": 4, "tp": 2}
    assert parse_mesh_spec({"data": 2, "fsdp": 4}) == {"data": 2, "fsdp": 4}
    for bad in ("fsdp4", "fsdp=0", ""):
        with pytest.raises(ValueError, match="fsdp"):
            parse_mesh_spec(bad)


def test_correspondence_from_plan_objects_and_dicts():
    plan = types.SimpleNamespace(kept_layers=[0, 2, 5], kept_hidden=[1, 3], kept_heads=None)
    corr = correspondence_from_plan(plan)
    assert corr.layer_map == ((0, 0), (2, 1), (5, 2)) and corr.kept_hidden == (1, 3)
    assert correspondence_from_plan({"kept_layers": [1, 3]}, layer_map=[(3, 1)]).layer_map == ((3, 1),)
    grouped = correspondence_from_plan({"kept_layers": [2, 3], "kept_heads": [[[0, 1]], [[2], [7]]]})
    assert grouped.head_map == ((0, 1), (2, 7))  # per student KV head in a surgery plan, flattened in head order
    with pytest.raises(ValueError, match="kept_layers"):
        correspondence_from_plan({})
    with pytest.raises(ValueError, match="out of range"):
        Correspondence(((7, 0),)).validate(teacher_layers=4, student_layers=2)


def test_default_layer_map_is_identity_or_uniform_ending_at_the_last_layer():
    def model(layers):
        return types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=layers))

    assert resolve_correspondence(DistillConfig(), model(3), model(3)).layer_map == ((0, 0), (1, 1), (2, 2))
    assert resolve_correspondence(DistillConfig(), model(6), model(3)).layer_map == ((1, 0), (3, 1), (5, 2))
    plan = {"kept_layers": [0, 4]}
    assert resolve_correspondence(DistillConfig(plan=plan), model(6), model(2)).layer_map == ((0, 0), (4, 1))


def test_logit_chunk_default_fits_the_device():
    """None: 128 rows on CPU; on an accelerator 2048 rows, fewer where a (rows, 262144) float32 block would take
    more than 1/16 of the device's memory; an explicit chunk always wins."""
    from nnx_surgery.distill.loop.run_config import DistillConfig
    from nnx_surgery.distill.loop.step_runner import accelerator_logit_chunk, logit_chunk

    assert logit_chunk(DistillConfig()) == 128  # these tests run on CPU
    assert logit_chunk(DistillConfig(logit_chunk=96)) == 96
    assert accelerator_logit_chunk(141 * 2**30) == 2048 and accelerator_logit_chunk(80 * 2**30) == 2048
    assert accelerator_logit_chunk(int(15.75 * 2**30)) == 512 and accelerator_logit_chunk(16 * 2**30) == 1024
    assert accelerator_logit_chunk(2**30) == 256
    assert accelerator_logit_chunk(None) == 2048  # no memory figure: the measured setting
    with pytest.raises(ValueError, match="logit_chunk=0"):
        DistillConfig(logit_chunk=0)


def test_policy_target_and_oom_settings_validate_and_round_trip_through_json():
    import json

    from nnx_surgery.distill.loop.run_config import GuardConfig, OOMConfig, TargetsConfig

    config = DistillConfig.from_dict({
        "stages": [{"steps": 2, "frozen": ["embed_tokens"], "weights": {"kl": [0.0, 1.0], "ce": 1.0},
                    "temperature": [3, 1, "cosine"]}, {"epochs": 0.25, "name": "tail"}],
        "guard": {"policies": ["switch_to_mse", "sft_then_mix"], "mse_on": "features", "sft_alpha": 0.3},
        "targets": {"kl_below": 0.05, "perplexity_below": 20.0, "stop_when_met": True},
        "oom": {"sequence": ["full", "halve_batch"]}, "feature_kind": "pooled", "logger": "wandb",
        "wandb_project": "kd", "plan": {"kept_layers": [0, 2], "kept_hidden": None, "kept_heads": None}})
    assert config.guard.policies == ("switch_to_mse", "sft_then_mix") and config.oom.sequence == ("full", "halve_batch")
    assert config.targets == TargetsConfig(kl_below=0.05, perplexity_below=20.0, stop_when_met=True)
    assert DistillConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    # the older fields of the feature and MSE terms' options read as the terms' options
    assert config.loss_options == {"feature": {"kind": "pooled"}, "mse": {"on": "features"}}
    assert GuardConfig(policies="switch_to_mse").policies == ("switch_to_mse",)
    for bad, match in ((lambda: GuardConfig(policies=("retry",)), "unknown policies"),
                       (lambda: DistillConfig.from_dict({"guard": {"mse_on": "hidden"}}), "on='hidden'"),
                       (lambda: GuardConfig(sft_alpha=2.0), "sft_alpha"),
                       (lambda: TargetsConfig(kl_below=float("nan")), "kl_below"),
                       (lambda: OOMConfig(sequence=("dots", "quarter_batch")), "quarter_batch"),
                       (lambda: DistillConfig(logger="tensorboard"), "logger"),
                       (lambda: DistillConfig.from_dict({"feature_kind": "max"}), "pooled"),
                       (lambda: DistillConfig.from_dict({"targets": {"kl_above": 1}}), "kl_above"),
                       (lambda: DistillConfig.from_dict({"stages": [{"step": 3}]}), r"stages\[0\]")):
        with pytest.raises(ValueError, match=match):
            bad()
    with pytest.raises(ValueError, match="NNX filter"):
        DistillConfig(stages=(Stage(steps=1, frozen=lambda path, value: True),)).to_dict()
