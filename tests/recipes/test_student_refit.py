"""The recipe's MLP refit (`recipes.student_refit`): its batches hold at most 8 rows and, past one row, at most
8,192 tokens, in the run and in `--aot`'s program alike (at 8 rows of 8,192 tokens Gemma 7B's stage-A refit needs
44 GiB per chip of a v5e-8)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from nnx_surgery import surgery
from nnx_surgery.recipes.compress import student_refit


@pytest.mark.parametrize("seq_len, rows", [(32, 8), (256, 8), (1024, 8), (2048, 4), (4096, 2), (8192, 1),
                                           (32768, 1)])
def test_batch_rows_keep_a_batch_within_its_tokens(seq_len, rows):
    assert student_refit.batch_rows(seq_len) == rows
    assert rows == 1 or rows * seq_len <= student_refit.BATCH_TOKENS


@pytest.mark.parametrize("seq_len", [256, 8192])
def test_the_run_refits_in_batches_of_those_rows(monkeypatch, seq_len):
    asked = {}

    def refit_mlp(student, source, plan, rows, **options):
        asked.update(options, rows=np.shape(rows))
        return surgery.RefitReport(rows=len(rows), tokens=int(np.size(rows)), ridge=1e-2, layers=(), seconds=0.0)

    monkeypatch.setattr(student_refit.surgery, "refit_mlp", refit_mlp)
    config = types.SimpleNamespace(surgery=types.SimpleNamespace(refit_rows=16), run=types.SimpleNamespace(seed=0),
                                   data=types.SimpleNamespace(seq_len=seq_len))
    data = types.SimpleNamespace(calibration_ids=lambda rows, seed: np.zeros((rows, seq_len), np.int32))
    assert student_refit.refit_student(types.SimpleNamespace(config=config), None, None, None, data) is None
    assert asked == {"batch_size": student_refit.batch_rows(seq_len), "rows": (16, seq_len)}
