"""Run metrics: FLOP accounting by hand, MFU peak lookup, JSONL / TensorBoard / PNG outputs."""
import json
import os
import sys
import types

import pytest

from nnx_surgery.distill.loop.metrics import (MetricsLogger, device_peak_flops, matrix_parameters, plot_history,
                                              step_flops)
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model


def _model(layers: int):
    return create_model(ModelConfig.from_hf_dict(dict(
        model_type="gemma", vocab_size=50, hidden_size=8, intermediate_size=12, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4)))


def test_step_flops_count_matrices_and_attention():
    d, f, n, k, h, v, t = 8, 12, 2, 1, 4, 50, 16
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f
    teacher, student = _model(3), _model(1)
    assert matrix_parameters(student) == v * d + per_layer  # tied table counted once, as the LM head
    attention = 4 * t * n * h  # per token and layer: scores and values over the full T x T block
    expected = 32 * (6 * (v * d + per_layer) + 2 * (v * d + 3 * per_layer)) + 32 * (3 * attention + 3 * attention)
    assert step_flops(student, teacher, tokens=32, seq_len=t) == expected


def test_a_trimmed_students_teacher_is_counted_at_the_kept_pieces():
    """The teacher of a trimmed student multiplies only the head rows of the kept pieces: 2 x (V - kept) x D
    FLOPs per token fewer than the whole teacher; the student's own count is unchanged."""
    from nnx_surgery.distill.trimmed_vocab import TeacherInStudentVocabulary

    d, v, kept, t = 8, 50, 20, 16
    teacher, student = _model(3), _model(1)
    whole = step_flops(student, teacher, tokens=32, seq_len=t)
    wrapped = TeacherInStudentVocabulary(teacher, list(range(kept)))
    assert wrapped.unused_head_parameters() == (v - kept) * d
    assert step_flops(student, wrapped, tokens=32, seq_len=t) == whole - 32 * 2 * (v - kept) * d


def test_peak_flops_configured_or_unknown_on_cpu():
    assert device_peak_flops(1e12) == 1e12
    assert device_peak_flops(None) is None  # CPU: no MFU unless a peak is configured


def test_logger_writes_jsonl_tensorboard_and_curves(tmp_path, monkeypatch):
    scalars = []

    class Writer:
        def __init__(self, folder):
            self.folder = folder

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=Writer))
    logger = MetricsLogger(str(tmp_path), total_steps=2, progress=True)
    for step in (1, 2):
        logger.step({"step": step, "loss": 1.0 / step, "loss/logit": 1.0 / step, "kl": 0.5, "student_ce": 2.0,
                     "teacher_ce": 1.5, "tokens_per_s": 100.0, "loss_nan": float("nan")})
    logger.evaluation({"step": 2, "eval": True, "student_ce": 1.9, "perplexity": 6.7, "kl": 0.4})
    logger.message("rolled back", event="rollback", failed_step=3)
    logger.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("step") for r in records[:3]] == [1, 2, 2] and records[-1]["event"] == "rollback"
    assert ("train/loss", 0.5, 2) in scalars and ("eval/perplexity", 6.7, 2) in scalars
    assert not any(tag == "train/loss_nan" for tag, *_ in scalars[:-1]) and scalars[-1] == "closed"
    path = plot_history(logger.records, str(tmp_path / "curves.png"))
    assert path and os.path.getsize(path) > 1000
    assert plot_history([], str(tmp_path / "none.png")) is None


@pytest.mark.parametrize("kind,peak", [("NVIDIA H200", 989e12), ("TPU v5 lite", 197e12)])
def test_peak_table_by_device_kind(monkeypatch, kind, peak):
    import jax

    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(device_kind=kind)])
    assert device_peak_flops() == peak
