"""recipes/distill_then_dpo.py at tiny scale, offline: a pruned student distilled, then DPO in Tunix on preference
pairs built from the standard library's source, saved as an HF folder transformers loads; its refusals are one
line and exit code 2."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("tunix", reason="the tunix extra is not installed (see surgery.modeling.tunix.INSTALL_HINT)")
from nnx_surgery import surgery  # noqa: E402
from nnx_surgery.distill.inputs.byte_tokenizer import (BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_byte_tokenizer)  # noqa: E402
from hf_reference import assert_clean_loading, hf_logits, load_with_info, make_hf_model  # noqa: E402
from nnx_surgery.recipes import distill_then_dpo  # noqa: E402
from nnx_surgery import refusals

SMALL = ["--distill-steps", "4", "--dpo-steps", "3", "--pairs", "8", "--batch-size", "4", "--seq-len", "32",
         "--corpus-bytes", "200000", "--student", "layers=0.5,mlp=0.5"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A tiny Gemma 3 (sliding and global layers) with the byte tokenizer, made by transformers."""
    folder = str(tmp_path_factory.mktemp("byte-teacher"))
    make_hf_model("gemma3_text", vocab_size=VOCAB_SIZE, tie_word_embeddings=False, pad_token_id=PAD_ID,
                  eos_token_id=EOS_ID, bos_token_id=BOS_ID).save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder


@pytest.mark.slow
def test_recipe_distils_then_dpo_and_saves(teacher, tmp_path, capsys):
    out = tmp_path / "run"
    distill_then_dpo.main(["--teacher", teacher, "--output", str(out), *SMALL])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("distilled 4 steps, DPO 3 steps on 8 pairs") and "held-out preference accuracy" in line
    summary = json.loads((out / "summary.json").read_text())
    assert abs(summary["dpo_loss"][0] - np.log(2)) < 1e-4  # policy == reference at DPO's first step
    assert np.isfinite(summary["dpo_loss"][1]) and summary["heldout_margin"][0] != summary["heldout_margin"][1]
    student_dir = str(out / "student")
    assert (out / "student" / "plan.json").exists() and (out / "student" / "tokenizer.json").exists()
    reference, info = load_with_info(student_dir)
    assert_clean_loading(info)
    ids = np.random.default_rng(0).integers(4, VOCAB_SIZE, (2, 12)).astype(np.int32)
    want = hf_logits(reference, ids)
    got = np.asarray(surgery.load_pretrained(student_dir)(ids).logits)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--dpo-steps", "0"], "--dpo-steps 0: give at least 1"),
    (["--learning-rate", "0"], "--learning-rate 0"),
    (["--teacher", "/nonexistent/teacher-folder"], "teacher-folder"),
])
def test_refusals_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        refusals.guarded(distill_then_dpo.main, ["--output", str(tmp_path / "run"), *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[0] and err[0].startswith("error: ") and "Traceback" not in "".join(err)


def test_missing_tunix_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tunix", None)  # as if the extra were not installed
    with pytest.raises(SystemExit) as stop:
        refusals.guarded(distill_then_dpo.main, ["--output", str(tmp_path / "run")])
    assert stop.value.code == 2
    assert "pip install --no-deps google-tunix==0.1.7" in capsys.readouterr().err
