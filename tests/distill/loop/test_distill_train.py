"""End-to-end distillation runs on a tiny Gemma 2 teacher and a depth-pruned student (teacher layers 0 and 3):
loss and held-out perplexity go down, frozen parameters stay bit-identical, stages switch, resume is bit-exact,
the divergence guard rolls back, gradient accumulation equals a big batch. Their helpers are in distill_fixtures.py.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_surgery.distill.loop.train_step as step_lib
from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, GuardConfig, LossWeights, Stage
from nnx_surgery.distill.loop.freeze import path_string
from nnx_surgery.distill.loop.trainer import DivergenceError, run
from nnx_surgery.surgery.modeling.causal_lm import create_model

from distill_fixtures import (ArrayBatches, BATCH, FAST_COMPILE, LENGTH, VOCAB, params_numpy, student_from,
                              teacher_samples, tiny_config, tiny_teacher)

@pytest.fixture(scope="module")
def corpus():
    batches = teacher_samples(tiny_teacher(), 32, seed=1)
    return {"train": batches[:24], "eval": batches[24:]}


def test_progressive_run_lowers_loss_and_perplexity_with_frozen_parameters_intact(corpus, tmp_path):
    """A student cut by the surgery (4 -> 2 layers, hidden 32 -> 24, 4 -> 2 query heads): the plan supplies the
    layer map, the kept hidden channels (feature loss) and the kept heads (attention transfer)."""
    from nnx_surgery.surgery import StudentSpec, apply_plan, plan_student

    teacher = tiny_teacher()
    calibration = np.concatenate([b["input_ids"] for b in corpus["train"][:4]])
    plan = plan_student(teacher, StudentSpec(2, 24, 32, 2, 1), calibration=calibration)
    student = apply_plan(teacher, plan)
    before = params_numpy(student)
    stages = (Stage(steps=6, trainable=["layers.1"], learning_rate=2e-2, name="last layer"),
              Stage(steps=6, frozen=["embed_tokens", "*norm*"], learning_rate=1e-2, temperature=(2.0, 1.0),
                    weights=LossWeights(kl=1.0, attention=0.2, feature=0.05), name="all but embeddings"))
    config = DistillConfig(stages=stages, batch_size=BATCH, seq_len=LENGTH, plan=plan,
                           run_dir=str(tmp_path / "run"), progress=False, logit_chunk=16,
                           compiler_options=FAST_COMPILE)
    result = run(teacher, student, corpus["train"], config, eval_data=corpus["eval"])
    after = params_numpy(student)

    first, last = result.evals[0], result.evals[-1]
    assert last["kl"] < 0.9 * first["kl"], (first, last)  # measured 0.72 -> 0.61
    assert last["perplexity"] < 0.95 * first["perplexity"], (first, last)  # measured 50.4 -> 45.4
    assert [r["stage"] for r in result.history] == [0] * 6 + [1] * 6
    assert all("loss/attention" in r for r in result.history[6:]) and "loss/attention" not in result.history[0]
    for path in before:
        frozen = path == "embed_tokens" or ("norm" in path and not path.startswith("layers.1."))  # both stages
        assert np.array_equal(before[path], after[path]) == frozen, path
    stage_events = [e for e in result.events if e["event"] == "stage"]
    assert [e["stage"] for e in stage_events] == [0, 1]
    assert stage_events[1]["carried"] > 0  # layer-1 Adam moments and the step counter carried over
    assert result.history[6]["temperature"] == pytest.approx(2.0) and result.history[-1]["temperature"] == 1.0
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert sum(1 for r in records if "event" not in r and not r.get("eval")) == 12
    assert os.path.getsize(tmp_path / "run" / "curves.png") > 1000
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert saved["stages"][1]["frozen"] == ["embed_tokens", "*norm*"] and saved["plan"]["kept_layers"] == plan.kept_layers
    for key in ("term/kl", "student_ce", "perplexity", "tokens_per_s", "grad_norm", "loss/logit"):
        assert np.isfinite(result.history[-1][key]), key
    # full-vocabulary diagnostics come from the evaluation step; the train step skips them (and the
    # temperature-1 kl, which is not its loss term under a temperature schedule)
    assert not {"kl", "teacher_ce", "logit_corr"} & set(result.history[-1])
    assert all(np.isfinite(last[key]) for key in ("kl", "teacher_ce", "logit_corr", "student_ce"))


def _short_config(**changes):
    base = dict(stages=(Stage(steps=6, learning_rate=5e-3, weights=LossWeights.mixed(0.8)),), batch_size=BATCH,
                seq_len=LENGTH, progress=False, logit_chunk=16, compiler_options=FAST_COMPILE)
    return DistillConfig(**{**base, **changes})


def _in(dtype, student):
    nnx.update(student, jax.tree.map(lambda x: x.astype(dtype), nnx.state(student, nnx.Param)))
    return student


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_resume_from_checkpoint_is_bit_exact(corpus, tmp_path, dtype):
    """Also for a bfloat16 student: the checkpoint holds its float32 master weights, and the resume reads them
    back (rounding them to the student's bfloat16 would change every later step)."""
    reference = _in(dtype, student_from(tiny_teacher()))
    full = run(tiny_teacher(), reference, ArrayBatches(corpus["train"]),
               _short_config(checkpoint=CheckpointConfig(str(tmp_path / "a"), every=2)))
    interrupted = _in(dtype, student_from(tiny_teacher()))
    halted = run(tiny_teacher(), interrupted, ArrayBatches(corpus["train"]),
                 _short_config(checkpoint=CheckpointConfig(str(tmp_path / "b"), every=2), halt_after=3))
    assert halted.steps == 3
    fresh = _in(dtype, student_from(tiny_teacher(seed=5)))  # other weights: everything from the checkpoint
    resumed = run(tiny_teacher(), fresh, ArrayBatches(corpus["train"]),
                  _short_config(checkpoint=CheckpointConfig(str(tmp_path / "b"), every=2)))
    assert resumed.events[0]["event"] == "resume" and resumed.steps == 6
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[3:]]
    want, got = params_numpy(reference), params_numpy(fresh)
    assert all(np.array_equal(want[k], got[k]) and got[k].dtype == dtype for k in want)


def test_divergence_guard_rolls_back_and_lowers_the_learning_rate(corpus):
    batches = [dict(b) for b in corpus["train"][:10]]
    batches[4] = {**batches[4], "loss_mask": np.full((BATCH, LENGTH), np.nan, np.float32)}
    for b in batches:
        b.setdefault("loss_mask", np.ones((BATCH, LENGTH), np.float32))
    student = student_from(tiny_teacher())
    config = _short_config(checkpoint=CheckpointConfig(every=2), guard=GuardConfig(lr_backoff=0.5))
    result = run(tiny_teacher(), student, batches, config)
    rollbacks = [e for e in result.events if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["failed_step"] == 5 and rollbacks[0]["restored_step"] == 4
    assert "DIVERGENCE" in rollbacks[0]["message"]
    assert result.history[-1]["lr"] == pytest.approx(0.5 * 5e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 5 / 6))))
    assert all(np.isfinite(v).all() for v in params_numpy(student).values())

    poisoned = tiny_teacher()
    nnx.update(poisoned, jax.tree.map(lambda x: x * jnp.nan, nnx.state(poisoned, nnx.Param)))
    with pytest.raises(DivergenceError, match="giving up after 2 rollbacks"):
        run(poisoned, student_from(tiny_teacher()), corpus["train"],
            _short_config(guard=GuardConfig(max_rollbacks=2)))


def test_gradient_accumulation_equals_one_big_batch_and_bf16_compute_tracks_float32(corpus):
    """Two micro-batches of 4 give the same update as one batch of 8 (losses are normalised per step, here with
    prompt tokens masked and rematerialisation on); bf16 compute with a bf16 teacher keeps float32 masters and
    stays close to the float32 loss."""
    ids = np.concatenate([corpus["train"][0]["input_ids"], corpus["train"][1]["input_ids"]])
    mask = np.ones_like(ids, np.float32)
    mask[:, :3] = 0
    results = {}
    for accum, dtype in ((1, "float32"), (2, "float32"), (2, "bfloat16")):
        teacher = tiny_teacher(dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
        student = student_from(tiny_teacher())
        batches = [{"input_ids": ids.reshape(accum, -1, LENGTH)[i], "loss_mask": mask.reshape(accum, -1, LENGTH)[i]}
                   for i in range(accum)]
        config = _short_config(stages=(Stage(steps=1, learning_rate=1e-3, weights=LossWeights(kl=1, ce=0.5)),),
                               batch_size=8 // accum, grad_accum=accum, compute_dtype=dtype, remat="dots")
        results[accum, dtype] = (run(teacher, student, batches, config).history[0], params_numpy(student))
    (one, params_one), (two, params_two) = results[1, "float32"], results[2, "float32"]
    assert one["supervised_tokens"] == two["supervised_tokens"] == 8 * (LENGTH - 1 - 3)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    for path in params_one:
        np.testing.assert_allclose(params_two[path], params_one[path], rtol=0, atol=1e-5, err_msg=path)
    low, params_low = results[2, "bfloat16"]
    assert low["loss"] == pytest.approx(one["loss"], rel=2e-2)
    assert all(v.dtype == np.float32 for v in params_low.values())


def test_gradients_reach_only_trainable_parameters():
    teacher, student = tiny_teacher(), student_from(tiny_teacher())
    from nnx_surgery.distill.loop.freeze import split_trainable
    from nnx_surgery.distill.losses.divergence import LogitLossSettings

    graph, trainable, frozen = split_trainable(student, ["layers.0.mlp", "layers.1.self_attn.{q,k}_proj"])
    teacher_graph, teacher_state = nnx.split(teacher)
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True))
    loss_fn = step_lib.make_loss_fn(graph, teacher_graph, settings)
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)), jnp.int32)}
    hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, ce=1.0)), 0, 0.0)
    counts = {"tokens": jnp.float32(2 * (LENGTH - 1)), "positions": jnp.float32(2 * LENGTH)}
    loss = jax.grad(lambda p: loss_fn(p, frozen, teacher_state, batch, counts, hyper)[0])
    grads = jax.jit(loss, compiler_options=FAST_COMPILE)({"student": trainable, "proj": {}})
    paths = sorted(path_string(p) for p, _ in nnx.to_flat_state(grads["student"]))
    assert paths == ["layers.0.mlp.down_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                     "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.q_proj.weight"]
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_without_a_teacher_the_student_trains_on_hard_labels(corpus):
    student = create_model(tiny_config(2), seed=3)
    config = _short_config(stages=(Stage(steps=24, learning_rate=0.1, warmup_steps=3,
                                         weights=LossWeights(kl=0.0, ce=1.0)),))
    result = run(None, student, corpus["train"], config, eval_data=corpus["eval"][:2])
    first, last = result.evals[0], result.evals[-1]
    assert "kl" not in last and last["loss"] == pytest.approx(last["student_ce"])
    assert last["student_ce"] < first["student_ce"] - 0.15, (first, last)  # measured 4.55 -> 4.31
    assert "teacher_ce" not in result.history[0] and np.isfinite(result.history[-1]["tflops_per_s"])
    with pytest.raises(ValueError, match="teacher=None trains on hard labels only"):
        run(None, student, corpus["train"], _short_config())


def test_a_bfloat16_student_trains_float32_master_weights_in_one_compiled_step(corpus):
    """A student that comes in bfloat16 (the recipe's --precision bf16 cuts it from a bfloat16 teacher) trains
    float32 master copies: its result is the float32 student's, trained from the same values, rounded once at
    the end (not an update rounded away at every step); it comes back in bfloat16; and its train step compiles
    once (bfloat16 Adam moments that turned float32 after the first step recompiled it)."""
    from jax._src import dispatch, monitoring

    teacher = tiny_teacher()
    wide = student_from(teacher)
    narrow = student_from(teacher)
    state = nnx.state(narrow, nnx.Param)
    nnx.update(narrow, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    nnx.update(wide, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(narrow, nnx.Param)))
    config = _short_config(stages=(Stage(steps=4, learning_rate=1e-4),), compute_dtype="bfloat16")
    compiled = []

    def listen(event, seconds, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT and kwargs.get("fun_name") == "jit(step)":
            compiled.append(seconds)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        run(teacher, narrow, corpus["train"][:4], config)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    run(teacher, wide, corpus["train"][:4], config)
    assert len(compiled) == 1, compiled
    trained, reference = params_numpy(narrow), params_numpy(wide)
    assert all(v.dtype == jnp.bfloat16 for v in trained.values())
    for path in trained:
        np.testing.assert_array_equal(trained[path], reference[path].astype(jnp.bfloat16), err_msg=path)
    changed = [path for path in trained if not np.array_equal(trained[path], params_numpy(student_from(teacher))[
        path].astype(jnp.bfloat16))]
    assert changed, "a learning rate of 1e-4 moved no bfloat16 weight"


def test_stage_entry_makes_loaded_parameters_donatable_in_place(tmp_path):
    """XLA:CPU adopts the loader's aligned host buffers uncopied, and never aliases such a buffer to a donated
    step's output (one more copy of the trainable parameters at the peak); `_donatable` copies them so the step writes in
    place, and leaves the step's own outputs untouched."""
    from nnx_surgery.distill.loop.step_runner import _donatable
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained, save_pretrained
    save_pretrained(student_from(tiny_teacher()), str(tmp_path / "student"))
    loaded = jax.tree.leaves(nnx.state(load_pretrained(str(tmp_path / "student")), nnx.Param))
    owned = _donatable(loaded, set())
    pointers = [x.unsafe_buffer_pointer() for x in owned]
    doubled = jax.jit(lambda xs: [2 * x for x in xs], donate_argnums=0)(owned)
    assert [x.unsafe_buffer_pointer() for x in doubled] == pointers
    assert all(a is b for a, b in zip(_donatable(doubled, {id(x) for x in doubled}), doubled))
