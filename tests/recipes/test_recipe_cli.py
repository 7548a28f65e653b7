"""The recipe's command line: `--student` shapes for any Gemma teacher, and one clear line (exit 2) instead of a
traceback for every refusal; `--debug` keeps the traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_reference import make_hf_model, save_hf, save_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
sys.path.insert(0, ROOT)

from nnx_surgery import model_inputs  # noqa: E402
from nnx_surgery import surgery  # noqa: E402


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny Gemma 3 teacher folder (4 layers, hidden 32, MLP 48, 4 heads, 2 KV heads) with a tokenizer."""
    folder = str(tmp_path_factory.mktemp("teacher"))
    save_hf(make_hf_model("gemma3_text"), folder)
    save_tiny_tokenizer(folder)
    return folder


def run(*args, cwd=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, RECIPE, *args], capture_output=True, text=True, env=env, timeout=300,
                           cwd=cwd)


@pytest.mark.parametrize("text, sizes", [
    ("layers=3,mlp=24", (3, 32, 24, 4, 2)),
    ("layers=0.5,mlp=0.5,heads=2,kv_heads=1", (2, 32, 24, 2, 1)),
    ("hidden=16", (4, 16, 48, 4, 2)),
])
def test_student_shapes_parse_against_the_teacher(teacher, text, sizes):
    spec = model_inputs.student_spec(text, surgery.ModelConfig.from_file(teacher))
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
            spec.num_key_value_heads) == sizes


@pytest.mark.parametrize("text, culprit", [
    ("layers=9", "num_layers"),             # deeper than the teacher
    ("mlp=64", "intermediate_size"),        # wider than the teacher
    ("depth=3", "depth"),                    # unknown key
    ("layers=two", "layers"),               # not a number
    ("layers=-1", "layers"),                # not a size
    ("heads=3", "head"),                     # heads not a multiple of the KV heads
    ("gemma-9000", "gemma-9000"),           # unknown named shape
])
def test_bad_student_shapes_raise_spec_errors_naming_the_size(teacher, text, culprit):
    with pytest.raises(surgery.SpecError) as error:
        model_inputs.student_spec(text, surgery.ModelConfig.from_file(teacher))
    assert culprit in str(error.value)


def test_a_bad_shape_is_one_line_and_exit_2_and_debug_keeps_the_traceback(teacher, tmp_path):
    proc = run("--teacher", teacher, "--student", "layers=9", "--dry-run", "--output", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: SpecError:") and "num_layers" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2  # the error, and where the traceback is
    debug = run("--teacher", teacher, "--student", "layers=9", "--dry-run", "--output", str(tmp_path / "run"),
                "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_a_teacher_that_is_not_7b_shaped_gets_a_clear_line_not_a_traceback(teacher, tmp_path):
    """The 7b preset's student is the gemma-2b shape, wider than this teacher: say so, exit 2."""
    proc = run("--teacher", teacher, "--dry-run", "--output", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "SpecError" in proc.stderr


def test_dry_run_takes_an_explicit_student_for_any_teacher(teacher, tmp_path):
    proc = run("--teacher", teacher, "--student", "layers=2,mlp=0.5", "--dry-run", "--output", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert "layers" in proc.stdout and "24" in proc.stdout


@pytest.mark.parametrize("flags, culprit", [
    (["--alpha", "1.5"], "--alpha"),
    (["--temperature", "0"], "--temperature"),
    (["--halt-after", "nowhere:3"], "--halt-after"),
    (["--teacher", "gguf:llama-9b"], "gguf:llama-9b"),
    (["--teacher", "missing/model.gguf"], "missing/model.gguf"),
    (["--config", "missing/run.json"], "missing/run.json"),
    (["--schedule", "progressive", "--trainable", "layers.1"], "--trainable"),
    (["--set", "guard.polcies=[]"], "polcies"),
])
def test_bad_flags_are_one_line_and_exit_2(teacher, tmp_path, flags, culprit):
    args = ["--teacher", teacher, "--student", "layers=2", "--output", str(tmp_path / "r"), *flags]
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and culprit in proc.stderr


def test_a_non_empty_output_folder_is_refused_unless_overwrite(teacher, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run("--teacher", teacher, "--student", "layers=2", "--output", str(out), "--data", teacher)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and "not empty" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_loss_weight_flags_reach_the_stages():
    """--alpha, --feature-weight and --cosine-weight become the stage's LossWeights (cosine with feature)."""
    from nnx_surgery.recipes import compress_command as recipe
    from nnx_surgery.recipes.compress import phase_configs
    from nnx_surgery import distill

    args = recipe.parse_args(["--preset", "tiny", "--output", "unused", "--alpha", "0.75", "--cosine-weight", "0.2"])
    assert phase_configs.loss_weights(args, 0.5) == distill.LossWeights(kl=0.75, ce=0.25, feature=0.5, cosine=0.2)
    assert phase_configs.loss_weights(recipe.parse_args(["--output", "unused"]), 0.0).active() <= {"kl", "ce"}
