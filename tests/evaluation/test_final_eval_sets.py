"""The recipe's held-out sets (nnx_surgery/evaluation/final_eval.py): a Python install without the far-domain files loses that set
with one printed line, not the run."""
from __future__ import annotations

import sysconfig

from nnx_surgery.evaluation import final_eval


def test_an_install_without_the_far_domain_files_skips_that_set(monkeypatch, tmp_path, capsys):
    assert len(final_eval._far_texts()) >= 32
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert final_eval._far_texts() == []
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("[eval] no far-domain set: far_prose: none of LICENSE.txt")
