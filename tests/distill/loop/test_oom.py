"""Out-of-memory handling (nnx_surgery/distill/loop/oom.py): a compile hook injects RESOURCE_EXHAUSTED (CPU memory is too plentiful
to run out of honestly); the run retries with remat "layers_dots", then "layers", then half the micro-batch and twice the
accumulation, whose update equals the original one; each decision is an event, lands in the run folder and
survives a resume."""
import json

import jax
import numpy as np
import pytest

from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, LossWeights, OOMConfig, Stage
from nnx_surgery.distill.loop.oom import MemoryPlan, compile_hooks, is_out_of_memory, split_micro_batches
from nnx_surgery.distill.loop.trainer import OutOfMemoryError, run
from distill_fixtures import FAST_COMPILE, LENGTH, ArrayBatches, params_numpy, student_from, teacher_samples
from distill_fixtures import tiny_teacher


def resource_exhausted() -> jax.errors.JaxRuntimeError:
    return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")


@pytest.fixture
def oom_when():
    """Install a compile hook that raises RESOURCE_EXHAUSTED when `predicate(request)`; records every request."""
    requests = []

    def install(predicate):
        def hook(request):
            requests.append(request)
            if predicate(request):
                raise resource_exhausted()
        compile_hooks.append(hook)
        return requests

    yield install
    compile_hooks.clear()


@pytest.fixture(scope="module")
def batches():
    return teacher_samples(tiny_teacher(), 6, seed=4)  # batches of 4 rows


def config(**changes):
    base = dict(stages=(Stage(steps=2, learning_rate=1e-3, weights=LossWeights(kl=1.0, ce=0.5)),), batch_size=4,
                seq_len=LENGTH, progress=False, logit_chunk=16, compiler_options=FAST_COMPILE)
    return DistillConfig(**{**base, **changes})


def test_out_of_memory_errors_and_the_retry_sequence():
    assert is_out_of_memory(resource_exhausted())
    assert not is_out_of_memory(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad shape"))
    assert not is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED"))  # not an XLA error
    plan = MemoryPlan(remat="dots")  # already rematerialising dots: that entry changes nothing and is skipped
    assert plan.next_action(("dots", "full", "halve_batch", "halve_batch"), micro_batch=2, data_split=1) == "full"
    plan.apply("full", 3, "oom", 2, 1)
    assert plan.next_action(("dots", "full", "halve_batch", "halve_batch"), 2, 1) == "halve_batch"
    plan.apply("halve_batch", 3, "oom", 2, 1)
    assert plan.next_action(("dots", "full", "halve_batch", "halve_batch"), 1, 1) is None  # one row: cannot halve
    assert plan.decisions[-1]["after"] == {"remat": "full", "micro_batch": 1, "grad_accum": 2}
    assert MemoryPlan(None).next_action(("halve_batch",), micro_batch=4, data_split=4) is None  # 2 rows on 4 shards
    ids = np.arange(2 * 4 * 3).reshape(2, 4, 3)
    split = split_micro_batches({"input_ids": ids}, 2)["input_ids"]
    assert split.shape == (4, 2, 3) and np.array_equal(split.reshape(2, 4, 3), ids)


def test_retries_layer_remats_then_half_the_micro_batch_with_the_same_update(batches, oom_when, tmp_path):
    reference = student_from(tiny_teacher())
    want = run(tiny_teacher(), reference, batches, config())
    requests = oom_when(lambda r: r.micro_batch > 2)  # only micro-batches of 2 rows fit
    student = student_from(tiny_teacher())
    got = run(tiny_teacher(), student, batches, config(run_dir=str(tmp_path / "run"), plots=False))
    assert [(r.remat, r.micro_batch, r.grad_accum) for r in requests] == [
        (None, 4, 1), ("layers_dots", 4, 1), ("layers", 4, 1), ("layers", 2, 2)]
    events = [e for e in got.events if e["event"] == "oom"]
    assert [e["action"] for e in events] == ["layers_dots", "layers", "halve_batch"]
    assert all(e["step"] == 0 and e["reason"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED") for e in events)
    assert events[-1]["after"] == {"remat": "layers", "micro_batch": 2, "grad_accum": 2} == got.oom_decisions[-1]["after"]
    # the optimizer step is unchanged: same global batch and token normalisation per update
    for one, two in zip(want.history, got.history):
        assert two["supervised_tokens"] == one["supervised_tokens"] == 4 * (LENGTH - 1)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    params_want, params_got = params_numpy(reference), params_numpy(student)
    for path in params_want:
        np.testing.assert_allclose(params_got[path], params_want[path], rtol=0, atol=1e-5, err_msg=path)
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert (saved["remat"], saved["batch_size"], saved["grad_accum"]) == ("layers", 2, 2)
    assert DistillConfig.from_dict(saved).remat == "layers"  # the run can be repeated from its folder
    assert json.load(open(tmp_path / "run" / "oom_decisions.json")) == got.oom_decisions
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["action"] for r in logged if r.get("event") == "oom"] == ["layers_dots", "layers", "halve_batch"]


def test_a_resumed_run_starts_with_the_decisions(batches, oom_when, tmp_path):
    requests = oom_when(lambda r: r.remat is None)
    checkpoint = CheckpointConfig(str(tmp_path / "ckpt"), every=1)
    run(tiny_teacher(), student_from(tiny_teacher()), ArrayBatches(batches), config(checkpoint=checkpoint,
                                                                                    halt_after=1))
    assert [r.remat for r in requests] == [None, "layers_dots"]
    requests.clear()
    resumed = run(tiny_teacher(), student_from(tiny_teacher()), ArrayBatches(batches), config(checkpoint=checkpoint))
    assert [r.remat for r in requests] == ["layers_dots"] and resumed.steps == 2  # no failed attempt again
    assert resumed.oom_decisions[0]["action"] == "layers_dots"


def test_when_every_retry_fails_the_error_says_what_was_tried(batches, oom_when):
    oom_when(lambda r: True)
    with pytest.raises(OutOfMemoryError, match="after trying layers_dots, layers, halve_batch") as caught:
        run(tiny_teacher(), student_from(tiny_teacher()), batches, config())
    assert is_out_of_memory(caught.value.__cause__) and "Lower batch_size" in str(caught.value)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        run(tiny_teacher(), student_from(tiny_teacher()), batches, config(oom=OOMConfig(retry=False)))


def test_an_out_of_memory_step_that_consumed_its_state_is_restored_and_skipped(batches, monkeypatch):
    """A failure after the step took its (donated) inputs: the state is restored from the last good copy and the
    batch skipped, as after a divergence."""
    from nnx_surgery.distill.loop.step_runner import StepRunner

    real, calls = StepRunner.train_step, []

    def fail_once_after_donation(self, batch, hyper):
        out = real(self, batch, hyper)
        calls.append(1)
        if len(calls) == 2:  # the second step: its state is gone, then the error
            jax.tree.map(lambda x: x.delete(), (self.params, self.opt))
            raise resource_exhausted()
        return out

    monkeypatch.setattr(StepRunner, "train_step", fail_once_after_donation)
    result = run(tiny_teacher(), student_from(tiny_teacher()), batches,
                 config(stages=(Stage(steps=3, learning_rate=1e-3),), checkpoint=CheckpointConfig(every=1)))
    event, = [e for e in result.events if e["event"] == "oom"]
    assert event["action"] == "layers_dots" and "consumed the training state, restored step 1" in event["message"]
    assert [r["step"] for r in result.history] == [1, 2, 3] and result.steps == 3
    assert all(np.isfinite(v).all() for v in params_numpy(result.student).values())
