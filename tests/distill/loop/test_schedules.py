"""Named schedules (progressive unfreezing, SFT-then-distil), stage lengths in epochs of the data, and loss weights
that ramp within a stage: traced into the step (no recompilation) and applied at every step."""
import json
import math
import types

import numpy as np
import pytest
from jax import monitoring

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Ramp, Stage
from nnx_surgery.distill.inputs.batches import TokenBatches
from nnx_surgery.distill.loop.freeze import describe_split, split_trainable
from nnx_surgery.distill.loop.schedules import progressive, resolve_epochs, sft_then_distil, steps_per_epoch
from nnx_surgery.distill.inputs.sources import DataError
from nnx_surgery.distill.loop.train_step import hyper_values
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model


def test_progressive_defaults_are_the_three_described_stages():
    stages = progressive(10, 30)
    assert [s.steps for s in stages] == [10, 10, 10]
    assert [s.frozen for s in stages] == [("layers.{0-7}",), ("layers.{0-4}",), None]  # 80%, 50%, none
    assert [s.learning_rate for s in stages] == [1e-4, 5e-5, 1e-5]
    assert all(s.weights == LossWeights(kl=0.5, ce=0.5) for s in stages)
    assert all(s.min_lr_ratio == 1.0 and s.learning_rate_at(s.steps - 1) == pytest.approx(s.learning_rate)
               for s in stages)  # each stage holds its rate
    # temperature: one straight line 3 -> 1 over the whole run, each stage carrying its piece
    per_step = [s.temperature_at(i) for s in stages for i in range(s.steps)]
    assert per_step == pytest.approx(np.linspace(3.0, 1.0, 30).tolist(), abs=1e-12)
    assert DistillConfig(stages=stages).total_steps == 30


def test_progressive_freezes_the_first_layers_of_a_real_model():
    model = create_model(ModelConfig.from_hf_dict(dict(
        model_type="gemma", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=10,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8)), seed=0)
    per_layer = describe_split(*split_trainable(model, None, "layers.0")[1:])["frozen"]
    for stage, frozen_layers in zip(progressive(10, 3), (8, 5, 0)):
        _, trainable, frozen = split_trainable(model, stage.trainable, stage.frozen)
        assert describe_split(trainable, frozen)["frozen"] == frozen_layers * per_layer


def test_every_number_of_progressive_is_a_parameter():
    stages = progressive(12, 100, frozen_fractions=(0.5, 0.25), learning_rates=(2e-4, 1e-4), shares=(3, 1),
                         temperature=(4.0, 2.0), alpha=0.8, divergence="jsd", extra_weights={"attention": 0.1},
                         extra_frozen=["embed_tokens"], layers_path="model.layers", warmup_steps=3,
                         min_lr_ratio=0.1)
    assert [s.steps for s in stages] == [75, 25]
    assert [s.frozen for s in stages] == [("model.layers.{0-5}", "embed_tokens"),
                                          ("model.layers.{0-2}", "embed_tokens")]
    assert stages[0].weights == LossWeights.mixed(0.8, "jsd", attention=0.1)  # 0.8 JSD + 0.2 CE
    assert stages[0].temperature.start == 4.0 and stages[-1].temperature.end == 2.0
    assert all(s.warmup_steps == 3 and s.min_lr_ratio == 0.1 for s in stages)
    with pytest.raises(ValueError, match="total_steps or epochs"):
        progressive(12)
    with pytest.raises(ValueError, match="one positive entry per stage"):
        progressive(12, 10, learning_rates=(1e-4,))
    with pytest.raises(ValueError, match="cannot give 3 stages"):
        progressive(12, 2)


def test_sft_then_distil_moves_from_cross_entropy_to_the_mix():
    stage = sft_then_distil(5, alpha=0.6)
    assert stage.weights_at(0) == pytest.approx({**stage.weights.as_dict(), "kl": 0.0, "ce": 1.0})
    assert stage.weights_at(4) == pytest.approx({**stage.weights.as_dict(), "kl": 0.6, "ce": 0.4})
    assert stage.weights_at(2)["kl"] == pytest.approx(0.3)


def _batches(num_rows: int, batch_size: int) -> TokenBatches:
    """Documents of 15 tokens + EOS pack into exactly `num_rows` rows of 16."""
    docs = np.arange(num_rows * 15, dtype=np.int32).reshape(num_rows, 15) % 50 + 1
    return TokenBatches.from_arrays(list(docs), eos_id=0, seq_len=16, batch_size=batch_size, eval_documents=0,
                                    seed=0)


def test_stages_in_epochs_resolve_against_the_data_and_cover_that_much_of_it():
    data = _batches(40, 4)
    assert data.num_rows == 40
    config = DistillConfig(stages=(Stage(epochs=0.5, name="half"), Stage(steps=3), Stage(epochs=1.0)),
                           grad_accum=2)
    with pytest.raises(ValueError, match="resolve_epochs"):
        config.total_steps
    assert steps_per_epoch(data, config) == 5.0  # 40 rows / (4 rows x 2 micro-batches)
    resolved = resolve_epochs(config, data)
    assert [s.steps for s in resolved.stages] == [round(2.5), 3, 5] and resolved.stages[0].epochs == 0.5
    for _ in range(5 * config.grad_accum):  # one epoch of optimizer steps visits every row once
        data.next_batch()
    assert (data.epoch, data.position) == (1, 0)
    again = DistillConfig.from_dict(json.loads(json.dumps(resolved.to_dict())))
    assert again == resolved and resolve_epochs(again, _batches(40, 4)) == resolved  # saved config: same steps
    assert resolve_epochs(DistillConfig(stages=(Stage(steps=2),)), object()).total_steps == 2  # data not asked
    with pytest.raises(DataError, match="num_rows"):
        resolve_epochs(config, [{"input_ids": np.zeros((4, 16), np.int32)}])
    with pytest.raises(ValueError, match="steps=N or epochs=X"):
        Stage()


def test_progressive_in_epochs():
    stages = progressive(10, epochs=1.5)
    assert [s.epochs for s in stages] == pytest.approx([0.5, 0.5, 0.5]) and all(s.steps is None for s in stages)
    resolved = resolve_epochs(DistillConfig(stages=stages), types.SimpleNamespace(num_rows=80, batch_size=4))
    assert [s.steps for s in resolved.stages] == [10, 10, 10]
    assert resolved.stages[0].temperature.start == 3.0 and resolved.stages[-1].temperature.end == 1.0


def test_ramped_weights_reach_the_traced_hyperparameters_and_survive_json():
    stage = Stage(steps=5, weights={"kl": [0.0, 1.0], "ce": [1.0, 0.0, "cosine"], "feature": 0.5})
    assert stage.weights.kl == 1.0 and stage.weights.active() == {"kl", "ce", "feature"}  # computed all stage
    kl = [float(hyper_values(stage, i, 0.0)["kl"]) for i in range(5)]
    ce = [float(hyper_values(stage, i, 0.0)["ce"]) for i in range(5)]
    assert kl == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert ce == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)], abs=1e-7)
    assert float(hyper_values(stage, 3, 0.0)["feature"]) == 0.5
    assert stage.weights.ramps == {"kl": Ramp(0.0, 1.0), "ce": Ramp(1.0, 0.0, "cosine")}
    assert LossWeights(stage.weights.to_dict()) == stage.weights != LossWeights(kl=1.0, ce=1.0, feature=0.5)
    assert repr(stage.weights) == "LossWeights(kl=[0.0, 1.0], ce=[1.0, 0.0, 'cosine'], feature=0.5)"
    assert LossWeights(kl=[0.5, 0.5]).ramps == {}  # equal ends: a constant
    with pytest.raises(ValueError, match="start, end"):
        LossWeights(kl=[0.0, 1.0, "linear", 3])
    with pytest.raises(ValueError, match="shape"):
        LossWeights(kl=[0.0, 1.0, "square"])


def test_a_weight_ramp_trains_with_the_moving_weights_and_never_recompiles():
    """SFT-then-distil in one stage: the loss of step i is w_kl(i) * KL + w_ce(i) * CE with the weights on their
    ramps, and the ramped run compiles nothing the constant-weight run did not."""
    from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, student_from, teacher_samples, tiny_teacher

    from nnx_surgery.distill.loop.trainer import run

    compiles: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if "backend_compile" in event else None)
    batches = teacher_samples(tiny_teacher(), 6, seed=1)

    def train(weights):
        config = DistillConfig(stages=(Stage(steps=5, learning_rate=1e-3, weights=weights),), batch_size=BATCH,
                               seq_len=LENGTH, progress=False, logit_chunk=16, compiler_options=FAST_COMPILE,
                               eval_every=100, eval_batches=1)
        compiles.clear()
        history = run(tiny_teacher(), student_from(tiny_teacher()), batches[:5], config,
                      eval_data=batches[5:]).history
        return history, len(compiles)

    _, _ = train(LossWeights(kl=0.5, ce=0.5))
    history, new_compiles = train(LossWeights(kl=[0.0, 1.0], ce=[1.0, 0.0]))
    assert new_compiles == 0
    for i, record in enumerate(history):
        want = (i / 4) * record["term/kl"] + (1 - i / 4) * record["term/ce"]
        assert record["loss"] == pytest.approx(want, rel=1e-5), i
    assert history[0]["loss"] == pytest.approx(history[0]["term/ce"], rel=1e-6)
