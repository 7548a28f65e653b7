"""Distilling into a student with a trimmed vocabulary (nnx_surgery/distill/trimmed_vocab.py): the loss against a numpy reference
(forward KL to the teacher's distribution restricted to the kept pieces and renormalised, CE on student ids), the
config field, and a short run of a surgery student with a trimmed vocabulary on text its own tokenizer made."""
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parents[2]))
from distill_fixtures import FAST_COMPILE, student_from, tiny_config, tiny_teacher  # noqa: E402

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage  # noqa: E402
from nnx_surgery.distill.losses.divergence import LogitLossSettings  # noqa: E402
from nnx_surgery.distill.mesh import make_mesh, model_on_mesh, shard_model  # noqa: E402
from nnx_surgery.distill.loop.train_step import StepSettings, build_eval_step, make_loss_fn, token_counts  # noqa: E402
from nnx_surgery.distill.loop.trainer import run  # noqa: E402
from nnx_surgery.distill.trimmed_vocab import TeacherInStudentVocabulary, in_student_vocabulary  # noqa: E402
from nnx_surgery.surgery.modeling.causal_lm import create_model  # noqa: E402

KEPT = np.sort(np.random.default_rng(4).choice(np.arange(3, 96), 37, replace=False))
KEPT = np.concatenate([[0, 1, 2], KEPT]).astype(np.int32)  # 40 of the teacher's 96 ids, specials first


def _numpy_reference(student_logits, teacher_logits, labels, weights, temperature: float):
    """Per supervised position: KL(p || q) at `temperature`, with p the teacher's softmax over the kept ids only,
    and the student's CE at temperature 1; weighted means."""
    t = np.asarray(teacher_logits, np.float64)[..., KEPT] / temperature
    s = np.asarray(student_logits, np.float64)
    log_p = t - np.log(np.exp(t - t.max(-1, keepdims=True)).sum(-1, keepdims=True)) - t.max(-1, keepdims=True)
    log_q_t = _log_softmax(s / temperature)
    kl = (np.exp(log_p) * (log_p - log_q_t)).sum(-1)
    ce = -np.take_along_axis(_log_softmax(s), labels[..., None], -1)[..., 0]
    teacher_ce = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
    mean = lambda x: float((x * weights).sum() / weights.sum())  # noqa: E731
    return mean(kl), mean(ce), mean(teacher_ce)


def _log_softmax(x):
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _trimmed_student():
    """Two layers of the tiny teacher's shape with its embedding rows at KEPT (the rest random)."""
    student = create_model(tiny_config(2).replace(vocab_size=len(KEPT)), seed=7)
    student.embed_tokens.set_value(tiny_teacher().embed_tokens[...][KEPT])
    return student


def test_restricted_loss_matches_a_numpy_reference():
    teacher, student = tiny_teacher(), _trimmed_student()
    wrapped = TeacherInStudentVocabulary(teacher, KEPT)
    ids = np.random.default_rng(2).integers(0, len(KEPT), (2, 12)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(wrapped(ids).logits), np.asarray(wrapped.logits_from_hidden(
        teacher(KEPT[ids], return_logits=False).final_hidden)))
    teacher_logits = np.asarray(teacher(KEPT[ids]).logits)  # the full vocabulary, gathered by the reference
    student_logits = np.asarray(student(ids).logits)
    labels = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], 1)
    weights = np.ones(ids.shape, np.float64)
    weights[:, -1] = 0
    batch = {"input_ids": jax.numpy.asarray(ids)}

    kl, ce, teacher_ce = _numpy_reference(student_logits, teacher_logits, labels, weights, 1.0)
    s_graph, s_state = nnx.split(student)
    t_graph, t_state = nnx.split(wrapped)
    metrics = build_eval_step(s_graph, t_graph, chunk=8, compiler_options=FAST_COMPILE)(s_state, t_state, batch)
    assert float(metrics["loss"]) == pytest.approx(kl, rel=2e-4)
    assert float(metrics["student_ce"]) == pytest.approx(ce, rel=2e-5)  # means over supervised tokens
    assert float(metrics["teacher_ce"]) == pytest.approx(teacher_ce, rel=2e-5)

    # the train step's fused loss: tau^2 KL(tau) + w_ce CE at temperature 2
    settings = StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=8, block=16))
    loss_fn = make_loss_fn(s_graph, t_graph, settings)
    trainable, frozen = nnx.state(student, nnx.Param), nnx.State({})
    hyper = {"temperature": 2.0, "kl": 1.0, "ce": 0.5, "reverse_kl": 0.0, "jsd": 0.0}
    loss, _ = loss_fn({"student": trainable, "proj": {}}, frozen, t_state, batch,
                      token_counts(jax.tree.map(lambda x: x[None], batch)), hyper)
    kl2, ce, _ = _numpy_reference(student_logits, teacher_logits, labels, weights, 2.0)
    assert float(loss) == pytest.approx(4.0 * kl2 + 0.5 * ce, rel=2e-4)


def test_vocab_map_is_checked_and_comes_from_the_plan():
    teacher, student = tiny_teacher(), _trimmed_student()
    assert DistillConfig.from_dict(DistillConfig(vocab_map=list(KEPT)).to_dict()).vocab_map == tuple(KEPT)
    plan = {"kept_layers": [0, 3], "kept_vocab": KEPT.tolist()}
    assert isinstance(in_student_vocabulary(teacher, student, DistillConfig(plan=plan)), TeacherInStudentVocabulary)
    assert in_student_vocabulary(teacher, student_from(teacher), DistillConfig()) is teacher
    assert DistillConfig(plan=plan).to_dict()["plan"]["kept_vocab"] == KEPT.tolist()
    for bad, message in (([3, 3, 4], "more than once"), ([[1, 2]], "list of teacher token ids"),
                         ([-1, 2], "negative")):
        with pytest.raises(ValueError, match=message):
            DistillConfig(vocab_map=bad)
    with pytest.raises(ValueError, match="outside the teacher's vocabulary"):
        TeacherInStudentVocabulary(teacher, [0, 96])
    with pytest.raises(ValueError, match="vocab_map has 39 teacher token ids but the student's vocabulary has 40"):
        in_student_vocabulary(teacher, student, DistillConfig(vocab_map=KEPT[:-1]))
    with pytest.raises(ValueError, match="differs from the plan's kept_vocab"):
        in_student_vocabulary(teacher, student, DistillConfig(plan=plan, vocab_map=KEPT[1:]))
    wrapped = TeacherInStudentVocabulary(teacher, KEPT)
    mesh = make_mesh("fsdp=1")
    shard_model(wrapped, mesh)  # the teacher's own shardings, the token map replicated
    assert model_on_mesh(wrapped, mesh) and np.asarray(wrapped(KEPT[None, :4] * 0).logits).shape == (1, 4, 40)
    with pytest.raises(ValueError, match="DistillConfig\\(plan=its plan\\) or vocab_map=plan.kept_vocab"):
        run(teacher, student, [], DistillConfig(stages=(Stage(steps=1),), progress=False))


def test_a_trimmed_student_distils_on_its_own_tokens(tmp_path):
    """The surgery's student with a 450-piece vocabulary (of 767), data tokenised by its own tokenizer: the run
    maps the teacher's input, restricts its head, and the held-out KL goes down."""
    from hf_reference import make_hf_model, save_hf
    from tiny_tokenizers import SAVERS, stdlib_text

    from nnx_surgery import distill
    from nnx_surgery.surgery import StudentSpec, apply_plan, load_pretrained, plan_student, save_student

    folder = str(tmp_path / "teacher")
    size = SAVERS["gemma"](folder)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size), folder)
    teacher = load_pretrained(folder)
    texts = [stdlib_text(name) for name in ("fnmatch.py", "glob.py", "genericpath.py", "tabnanny.py")]
    teacher_data = distill.TokenBatches.from_records(texts, folder, seq_len=32, batch_size=4, eval_fraction=0.2)
    plan = plan_student(teacher, StudentSpec(2, 32, 24, 4, 2, vocab_size=450), tokenizer=folder,
                        calibration=teacher_data.calibration_ids(32))
    student = apply_plan(teacher, plan)
    student_folder = save_student(student, plan, tmp_path / "student", source=folder, report=False)
    data = distill.TokenBatches.from_records(texts, student_folder, seq_len=32, batch_size=4, eval_fraction=0.2)
    assert max(int(b["input_ids"].max()) for b in data.eval_batches()) < 450
    config = DistillConfig(stages=(Stage(steps=10, learning_rate=3e-3, weights=LossWeights(kl=1.0)),), plan=plan,
                           batch_size=4, seq_len=32, progress=False, logit_chunk=16, eval_batches=2,
                           compiler_options=FAST_COMPILE, run_dir=str(tmp_path / "run"))
    result = run(teacher, student, data, config)
    first, last = result.evals[0], result.evals[-1]
    assert last["kl"] < 0.9 * first["kl"], (first, last)  # measured 0.31 -> 0.25
    assert all(np.isfinite(r["loss"]) for r in result.history)
    assert os.path.isfile(os.path.join(student_folder, "tokenizer.json"))


def test_a_trimmed_student_s_step_compiles_from_abstract_models():
    """--aot's path: the wrapped teacher is made from shapes alone (no weights to read), and the compiled step's
    arguments hold the student's trimmed head, the teacher's full one and the token map."""
    from nnx_surgery.distill.loop.lowering import train_step_program
    from nnx_surgery.surgery.modeling.causal_lm import abstract_model

    mesh = make_mesh("fsdp=1")
    teacher, student = abstract_model(tiny_config(4), mesh=mesh), abstract_model(
        tiny_config(2).replace(vocab_size=len(KEPT)), mesh=mesh)
    config = DistillConfig(stages=(Stage(steps=1),), batch_size=2, seq_len=16, plan={"kept_vocab": KEPT.tolist()},
                           compiler_options=FAST_COMPILE, progress=False)
    program = train_step_program(teacher, student, config, mesh, 0)
    shapes = {leaf.shape for leaf in jax.tree.leaves(program.parts["teacher"])}
    assert (len(KEPT),) in shapes and (96, 32) in shapes  # the token map and the teacher's embedding
    assert any(leaf.shape == (len(KEPT), 32) for leaf in jax.tree.leaves(program.parts["student"]))
    assert program.lower().compile().memory_analysis().argument_size_in_bytes > 0
