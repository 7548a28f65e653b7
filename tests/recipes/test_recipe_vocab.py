"""The recipe with a trimmed vocabulary (`--student ...,vocab=N`) end to end, offline, on a tiny BPE teacher (a
Gemma-style byte-fallback tokenizer of 767 pieces, tests/tiny_tokenizers.py, and random Gemma 3 weights): the
student folder loads in transformers with its trimmed tokenizer, every row is judged per byte, the trimmed
students' KL is against the teacher restricted to their pieces, staged compression trims in the final plan, and
bad values are one line and exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from hf_reference import assert_clean_loading, hf_logits, load_with_info, make_hf_model, save_hf
from recipe_env import recipe_env, shared_basetemp
from tiny_tokenizers import SAVERS

pytestmark = pytest.mark.slow  # recipe runs end to end

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
sys.path.insert(0, ROOT)
DATA_FILES = ("fnmatch.py", "glob.py", "genericpath.py", "tabnanny.py", "textwrap.py", "string.py", "bisect.py",
              "colorsys.py", "keyword.py", "shlex.py", "posixpath.py", "copy.py", "heapq.py", "quopri.py", "sched.py")
FAST = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--calibration-samples", "8", "--eval-tokens", "256",
        "--eval-batches", "2", "--precision", "fp32", "--learning-rate", "1e-3", "--warmup-steps", "1",
        "--control", "pruned-ce", "--feature-weight", "0"]
TEXTS = ["def main(argv):\n    return [x for x in argv if x.startswith('--')]\n",
         "Größenordnung, déjà vu — 東京 🚀 ∑ x ≤ ½\t\ttabs  and   spaces\n\n\n", ""]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(teacher folder, data folder, its vocabulary size, the session's base temporary folder)."""
    base = tmp_path_factory.mktemp("vocab-recipe")
    folder, data = str(base / "teacher"), base / "data"
    size = SAVERS["gemma"](folder)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size), folder)
    data.mkdir()
    for name in DATA_FILES:
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), data)
    return folder, str(data), size, shared_basetemp(tmp_path_factory)


def run_recipe(teacher, output, *extra, check=True):
    folder, data, _, basetemp = teacher
    proc = subprocess.run([sys.executable, RECIPE, "--teacher", folder, "--data", data, *FAST, "--output",
                           str(output), *extra], capture_output=True, text=True,
                          env=recipe_env(basetemp), timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def oneshot(teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab-oneshot") / "run"
    proc = run_recipe(teacher, out, "--student", "layers=2,mlp=24,vocab=400", "--compression", "oneshot",
                      "--eval-prompts", "2", "--new-tokens", "8", "--choice-items", "4", "--gguf", "f32")
    return out, proc


def test_the_student_folder_loads_in_transformers_with_its_trimmed_tokenizer(teacher, oneshot):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    import jax.numpy as jnp
    from nnx_surgery import surgery

    student = oneshot[0] / "student"
    config = json.loads((student / "config.json").read_text())
    kept = json.loads((student / "plan.json").read_text())["kept_vocab"]
    assert config["vocab_size"] == len(kept) == 400
    model, info = load_with_info(str(student))
    assert_clean_loading(info)
    ids = np.random.default_rng(0).integers(0, 400, (2, 20)).astype(np.int32)
    ours = np.asarray(surgery.load_pretrained(str(student), dtype="float32")(jnp.asarray(ids)).logits)
    assert np.abs(ours - hf_logits(model, ids)).max() <= 1e-4

    tokenizer = AutoTokenizer.from_pretrained(str(student))
    assert len(tokenizer) == 400
    teacher_tok = Tokenizer.from_file(os.path.join(teacher[0], "tokenizer.json"))
    for text in TEXTS + [open(os.path.join(teacher[1], "glob.py")).read()]:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert max(encoded, default=0) < 400 and tokenizer.decode(encoded) == text
        theirs = teacher_tok.encode(text, add_special_tokens=False).ids
        if set(theirs) <= set(kept):  # made of kept pieces: the teacher's tokens, renumbered
            assert [kept[i] for i in encoded] == theirs
    # the phases and the run folder hold the student's tokenizer, not the teacher's
    for folder in ("student_tokenizer", "phases/stage_b", "phases/control"):
        assert Tokenizer.from_file(str(oneshot[0] / folder / "tokenizer.json")).get_vocab_size() == 400


def test_every_row_is_judged_per_byte_and_trimmed_kl_is_against_the_restricted_teacher(teacher, oneshot):
    out, proc = oneshot
    results = json.loads((out / "results.json").read_text())
    by = {row["model"]: row for row in results["rows"]}
    assert list(by) == ["teacher", "pruned (before distillation)", "distilled student",
                        "CE-retrained pruned student (control)"]
    for name, row in by.items():
        trimmed = name != "teacher"
        assert row["vocab_size"] == (400 if trimmed else teacher[2]) and row["trimmed_vocabulary"] == trimmed
        assert all(np.isfinite(row[k]) and row[k] > 0 for k in ("loss_per_byte", "general_loss_per_byte"))
        assert row["safetensors_bytes"] == 4 * row["parameters"]  # float32, the embedding tied
    assert by["distilled student"]["parameters"] < by["teacher"]["parameters"]
    weights = sum(os.path.getsize(out / "student" / f) for f in os.listdir(out / "student") if f.endswith(".safetensors"))
    assert 0 < weights - by["distilled student"]["safetensors_bytes"] < 65536  # the file's JSON header
    general = results["sets"]["general"]
    pairs = {(c["a"], c["b"]): c for c in general["comparisons"]}
    across = pairs[("distilled student", "teacher")]
    assert across["ce"] is None and across["kl"] is None and "different tokenizers" in across["note"]
    assert across["ce_per_byte"]["difference"] == pytest.approx(
        by["distilled student"]["general_loss_per_byte"] - by["teacher"]["general_loss_per_byte"], abs=1e-9)
    assert across["ce_per_byte"]["low"] <= across["ce_per_byte"]["difference"] <= across["ce_per_byte"]["high"]
    same = pairs[("distilled student", "CE-retrained pruned student (control)")]
    assert same["ce"] is not None and same["kl"]["difference"] == pytest.approx(
        by["distilled student"]["general_kl"] - by["CE-retrained pruned student (control)"]["general_kl"], abs=1e-9)
    assert "nats/byte" in proc.stdout and "restricted to its kept pieces" in proc.stdout
    assert "| 400 (trimmed) |" in proc.stdout and "teacher restricted to 400 pieces" in (out / "suite.md").read_text()
    kl, floor = _restricted_teacher(teacher, out)
    assert by["distilled student"]["general_kl"] == pytest.approx(kl, rel=2e-3)
    trimmed = next(t for t in general["tokenizations"] if t["vocab_size"] == 400)
    assert trimmed["reference"] == "teacher restricted to 400 pieces"  # what the trimmed students' KL is against
    assert trimmed["reference_ce_per_byte"] == pytest.approx(floor, rel=2e-4)
    whole = next(t for t in general["tokenizations"] if t["vocab_size"] is None)
    assert whole["reference_ce_per_byte"] == pytest.approx(by["teacher"]["general_loss_per_byte"], rel=1e-9)
    assert f"scores {trimmed['reference_ce_per_byte']:.4f} nats/byte" in (out / "suite.md").read_text()


def _restricted_teacher(teacher, out) -> tuple[float, float]:
    """On the general set, from full logits in numpy (the teacher reads the passages in its ids, the student's
    mapped; its logits are gathered at the kept ids and renormalised): KL(restricted teacher || distilled student)
    per token, and the restricted teacher's own CE per byte on the student's tokens."""
    import jax.numpy as jnp

    from nnx_surgery import distill, evaluation
    from nnx_surgery import surgery

    held = evaluation.HeldoutSet.from_texts("general", distill.general_prose("heldout"), teacher[0], seq_len=32,
                                         max_tokens=256, seed=0).retokenised(str(out / "student"))
    kept = np.asarray(json.loads((out / "student" / "plan.json").read_text())["kept_vocab"])
    teacher_logits = np.asarray(surgery.load_pretrained(teacher[0])(jnp.asarray(kept[held.rows])).logits)
    student_logits = np.asarray(surgery.load_pretrained(str(out / "student"))(jnp.asarray(held.rows)).logits)

    def log_softmax(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(teacher_logits[..., kept]), log_softmax(student_logits)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    nll = -np.take_along_axis(log_p[:, :-1], held.rows[:, 1:, None], -1)[..., 0]
    return (float((kl * held.loss_mask).sum() / held.loss_mask.sum()),
            float((nll * held.loss_mask[:, :-1]).sum() / held.bytes))


def test_staged_compression_trims_the_vocabulary_in_the_final_plan(teacher, tmp_path):
    out = tmp_path / "staged"
    # no control run and no multiple choice here (the one-shot run above has both, trimmed)
    proc = run_recipe(teacher, out, "--student", "layers=2,hidden=24,mlp=24,heads=2,kv_heads=1,vocab=0.6",
                      "--compression", "staged", "--eval-prompts", "0", "--choice-items", "0", "--control", "none")
    student = out / "student"
    assert json.loads((student / "plan_stage_a.json").read_text()).get("kept_vocab") is None
    kept = json.loads((student / "plan.json").read_text())["kept_vocab"]
    assert len(kept) == round(0.6 * teacher[2]) == json.loads((student / "config.json").read_text())["vocab_size"]
    results = json.loads((out / "results.json").read_text())
    assert all(np.isfinite(row["general_loss_per_byte"]) for row in results["rows"])
    assert results["final_losses"]["kl"] > 0 and "nats/byte" in proc.stdout


def test_vocab_values_parse_and_bad_ones_are_one_line_and_exit_2(teacher, tmp_path):
    from nnx_surgery import model_inputs
    from nnx_surgery import surgery

    config = surgery.ModelConfig.from_file(teacher[0])
    assert model_inputs.student_spec("layers=2,mlp=24,vocab=400", config, tokenizer=teacher[0]).vocab_size == 400
    assert model_inputs.student_spec("layers=2,vocab=0.0625", config).vocab_size_for(config) == round(teacher[2] / 16)
    for text, message in (("vocab=3", "smaller than the 263 pieces"), ("vocab=9999", "larger than the teacher's"),
                          ("vocab=lots", "vocab='lots'"), ("vocab=0", "vocab='0'")):
        with pytest.raises(surgery.SpecError, match=message):
            model_inputs.student_spec(text, config, tokenizer=teacher[0])
    with pytest.raises(surgery.SpecError, match="keeps the teacher's vocabulary"):
        model_inputs.student_spec("vocab=400", config, vocabulary=False)
    proc = run_recipe(teacher, tmp_path / "bad" / "run", "--student", "layers=2,vocab=3", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: SpecError: --student 'layers=2,vocab=3': vocab_size=3 is smaller")
    assert len(proc.stderr.strip().splitlines()) == 2  # the error, and where the traceback is
    dry = run_recipe(teacher, tmp_path / "dry" / "run", "--student", "layers=2,vocab=400", "--compression",
                     "oneshot", "--dry-run")
    assert "vocab: 400 of the teacher's 767 pieces" in dry.stdout


def test_the_recipe_writes_the_trimmed_student_as_gguf(teacher, oneshot):
    """`--gguf f32`: the student beside its folder as one GGUF file, its vocabulary the trimmed one (what
    llama.cpp reads is tested in test_gguf_export.py); an unknown dtype is refused before any work."""
    import gguf

    out, proc = oneshot
    path = out / "student-f32.gguf"
    assert f"gguf: {path}" in proc.stdout
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    config = json.load(open(out / "student" / "config.json"))
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.block_count"] == 2
    assert len(fields["tokenizer.ggml.tokens"]) == config["vocab_size"] == 400
    assert fields["tokenizer.ggml.bos_token_id"] == config["bos_token_id"]
    card = (out / "student" / "README.md").read_text()  # the model card says how to run the file
    assert "`student-f32.gguf`" in card and "llama-cli -m student-f32.gguf" in card
    bad = run_recipe(teacher, out.parent / "bad-gguf", "--student", "layers=2", "--gguf", "q4_k_m", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: RecipeError: --gguf q4_k_m:"), bad.stderr
    assert not (out.parent / "bad-gguf").exists() or not any((out.parent / "bad-gguf").iterdir())
