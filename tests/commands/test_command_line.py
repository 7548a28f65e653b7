"""The installed command line, `nnx-surgery` / `python -m nnx_surgery` (nnx_surgery/cli.py, nnx_surgery/commands/):
help and version without jax, every subcommand on one tiny Gemma 3 teacher with a Gemma-style tokenizer
(tests/tiny_tokenizers.py), checked against the Python API and transformers, and one line (exit 2) for every
refusal. Subcommands run in this process (`cli.main`, so jax and its compilations are shared) unless what is
checked is the process itself (help, exit codes, the Hub's environment)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from fake_hub import FakeHub
from hf_reference import make_hf_model, save_hf
from recipe_env import recipe_env, shared_basetemp
from refusal_env import run  # `nnx-surgery ARGS` in this process
from tiny_tokenizers import TRAIN_FILES, save_gemma_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SPEC = "layers=3,mlp=24,heads=2,kv_heads=1,vocab=600"  # depth, MLP, heads, KV heads and vocabulary all cut
DATA = ["--seq-len", "32"]
SUBCOMMANDS = ("plan", "prune", "distill", "eval", "generate", "import-gguf", "export-gguf", "push")
TOKEN = "hf_fakeTokenForTheCommandLine5c1d9e"


def nnx_surgery(env: dict, *args: str) -> subprocess.CompletedProcess:
    """`python -m nnx_surgery ARGS` in a child process with the environment `env`."""
    return subprocess.run([sys.executable, "-m", "nnx_surgery", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


def ok(*args: str) -> str:
    code, out, err = run(*args)
    assert code == 0, f"nnx-surgery {' '.join(args)} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def assert_one_line_refusal(code, err: str, culprit: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and culprit in errors[0], err
    assert len(err.strip().splitlines()) <= 2, err  # the error, and at most where the traceback is


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """CPU, offline, and the session's JAX compilation cache (tests/recipe_env.py)."""
    return recipe_env(shared_basetemp(tmp_path_factory))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The tiny teacher (query_pre_attn_scalar = head_dim, so that a GGUF round trip changes no tensor), a data
    folder of standard library modules, and the plan and pruned student every later test starts from."""
    base = tmp_path_factory.mktemp("command-line")
    teacher, data = str(base / "teacher"), base / "data"
    size = save_gemma_tokenizer(teacher)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size, query_pre_attn_scalar=12), teacher)
    data.mkdir()
    for name in TRAIN_FILES + ("glob.py", "fnmatch.py", "copy.py", "heapq.py", "posixpath.py", "sched.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), data)
    plan, student = str(base / "plan.json"), str(base / "student")
    plan_out = ok("plan", teacher, "--student", SPEC, "--data", str(data), *DATA, "--calibration-samples", "16",
                  "--output", plan)
    prune_out = ok("prune", teacher, plan, student)
    return dict(base=base, teacher=teacher, data=str(data), plan=plan, student=student, plan_out=plan_out,
                prune_out=prune_out)


# ------------------------------------------------------------------------------------------------ help, version
def test_help_and_version_are_instant_and_every_subcommand_documents_itself(env):
    top = nnx_surgery(env, "--help")
    assert top.returncode == 0 and "compress" in top.stdout and "examples:" in top.stdout
    assert all(name in top.stdout for name in SUBCOMMANDS)
    version = nnx_surgery(env, "--version")
    assert version.returncode == 0 and version.stdout.strip() == "nnx-surgery 0.1.0"
    script = os.path.join(os.path.dirname(sys.executable), "nnx-surgery")  # pyproject's [project.scripts]
    assert os.path.isfile(script), "no nnx-surgery script beside python: run `pip install -e .` again"
    installed = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60, env=env)
    assert installed.returncode == 0 and installed.stdout == version.stdout
    for name in SUBCOMMANDS:
        sub = nnx_surgery(env, name, "--help")
        assert sub.returncode == 0, sub.stderr
        assert sub.stdout.startswith(f"usage: nnx-surgery {name}"), sub.stdout[:200]
        assert f"examples:\n  nnx-surgery {name} " in sub.stdout and "--debug" in sub.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, contextlib, io; from nnx_surgery import cli\n"
                            "for argv in (['--help'], ['plan', '--help'], ['push', '--help']):\n"
                            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                            "        cli.main(argv)\n"
                            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    recipe = nnx_surgery(env, "compress", "--help")  # the recipe's own flags
    assert recipe.returncode == 0 and recipe.stdout.startswith("usage: ")
    assert "--halt-after" in recipe.stdout and "--preset" in recipe.stdout


def test_compress_is_the_recipe(env, tmp_path):
    """A dry run of the tiny preset prints what the recipe's script prints; a refused flag exits 2 like it."""
    flags = ["--preset", "tiny", "--dry-run", "--cache-dir", str(tmp_path / "cache")]
    ours = nnx_surgery(env, "compress", *flags, "--output", str(tmp_path / "a"))
    script = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py"), *flags, "--output",
                             str(tmp_path / "a")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=env)
    assert ours.returncode == script.returncode == 0, ours.stderr + script.stderr
    assert ours.stdout == script.stdout and "memory per device" in ours.stdout
    bad = nnx_surgery(env, "compress", *flags, "--output", str(tmp_path / "b"), "--alpha", "1.5")
    assert bad.returncode == 2 and "--alpha" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------------------ the steps
def test_plan_then_prune_gives_a_folder_transformers_loads_with_the_plans_shape(workspace):
    import torch
    import transformers

    from nnx_surgery import surgery

    plan = surgery.Plan.load(workspace["plan"])
    spec = plan.student
    assert (spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
            spec.num_key_value_heads, spec.vocab_size) == (3, 32, 24, 2, 1, 600)
    assert "student: 3 layers" in workspace["plan_out"] and workspace["plan"] in workspace["plan_out"]
    model = transformers.AutoModelForCausalLM.from_pretrained(workspace["student"], dtype=torch.float32)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (3, 32, 24, 2, 1, 600)
    assert tuple(model.get_input_embeddings().weight.shape) == (600, 32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace["student"])  # the trimmed one
    assert len(tokenizer) == 600 and max(tokenizer("def main(argv):\n")["input_ids"]) < 600
    assert surgery.Plan.load(workspace["student"]).to_dict() == plan.to_dict()


def test_generate_prints_what_the_api_generates(workspace):
    from nnx_surgery import surgery

    prompt = "def main(argv):\n    return"
    out = ok("generate", workspace["student"], "--prompt", prompt, "--max-new-tokens", "8")
    model = surgery.load_pretrained(workspace["student"], dtype="float32")
    expected = surgery.generate(model, [prompt], max_new_tokens=8, tokenizer=workspace["student"])
    assert len(expected.tokens[0]) > 0
    assert out == expected.texts[0] + "\n"


def test_gguf_export_then_import_gives_the_same_tensors(workspace):
    from safetensors.numpy import load_file

    gguf_path, back = str(workspace["base"] / "teacher.gguf"), str(workspace["base"] / "back")
    assert "f32" in ok("export-gguf", workspace["teacher"], gguf_path, "--gguf-type", "f32")
    ok("import-gguf", gguf_path, back, "--dtype", "float32")
    source = load_file(os.path.join(workspace["teacher"], "model.safetensors"))
    imported = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(source) == sorted(imported)
    for name, values in source.items():
        assert imported[name].dtype == np.float32 and imported[name].shape == values.shape, name
        if name.endswith("norm.weight"):  # GGUF holds 1 + w (exact in float32); w comes back within a rounding
            np.testing.assert_array_equal(imported[name] + np.float32(1), values + np.float32(1), err_msg=name)
        else:
            np.testing.assert_array_equal(imported[name], values, err_msg=name)
    code, _, err = run("export-gguf", workspace["teacher"], gguf_path, "--gguf-type", "f32")  # exists: refused
    assert_one_line_refusal(code, err, "--overwrite")


@pytest.fixture(scope="module")
def distilled(workspace):
    out = str(workspace["base"] / "distilled")
    printed = ok("distill", workspace["teacher"], workspace["student"], "--data", workspace["data"], *DATA,
                 "--batch-size", "4", "--steps", "3", "--learning-rate", "1e-2", "--output", out)
    return out, printed


def test_distill_trains_the_student_and_keeps_its_plan_and_tokenizer(workspace, distilled):
    from safetensors.numpy import load_file

    out, printed = distilled
    assert "held-out CE:" in printed and out in printed
    with open(os.path.join(out, "history.json")) as f:
        history = json.load(f)
    assert [record["step"] for record in history["train"]][-1] == 3
    for name in ("plan.json", "tokenizer.json", "config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, "tokenizer.json"), "rb") as a, \
            open(os.path.join(workspace["student"], "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()  # the trimmed tokenizer, made again from the teacher's
    before = load_file(os.path.join(workspace["student"], "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_distill_in_bf16_saves_the_student_in_bfloat16(workspace):
    """--precision bf16: float32 masters in training, the folder in the run's precision (half the bytes), as the
    recipe's; one step is enough to see it."""
    out = str(workspace["base"] / "distilled-bf16")
    ok("distill", workspace["teacher"], workspace["student"], "--data", workspace["data"], *DATA, "--batch-size", "2",
       "--steps", "1", "--precision", "bf16", "--output", out)
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_eval_writes_a_table_with_every_folder(workspace, distilled):
    out = str(workspace["base"] / "eval")
    printed = ok("eval", "--teacher", workspace["teacher"], workspace["student"], distilled[0], "--data",
                 workspace["data"], *DATA, "--eval-tokens", "256", "--eval-prompts", "2", "--new-tokens", "8",
                 "--choice-items", "4", "--compare", "distilled:student", "--eval-tasks", "nnx_offline",
                 "--eval-tasks-limit", "2", "--tasks-batch", "4", "--output", out)
    with open(os.path.join(out, "suite.md")) as f:
        suite = f.read()
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    names = ["teacher", "student", "distilled"]
    assert [row["model"] for row in results["rows"]] == names
    assert set(results["sets"]) == {"in-domain", "general", "far-domain"}  # the general-prose sets too
    for name in names:
        assert f"| {name} |" in suite and f"| {name} |" in printed
    assert "### general" in suite and "## Sample generations" in suite
    assert f"written in {out}: suite.md, suite.json, results.json" in printed
    assert [row["vocab_size"] for row in results["rows"]] == [results["rows"][0]["vocab_size"], 600, 600]
    assert all(row["general_loss_per_byte"] > 0 and row["far_loss_per_byte"] > 0 for row in results["rows"])
    # --compare: the paired difference of two students (same tokens, same passages) is the difference of their
    # rows' per-byte CE, with an interval around it, in results.json and printed
    rows = {row["model"]: row for row in results["rows"]}
    assert results["sets"]["general"]["documents"] > 1  # so an interval is checked
    for part, key in (("in-domain", "loss_per_byte"), ("general", "general_loss_per_byte"),
                      ("far-domain", "far_loss_per_byte")):
        (pair,) = [c for c in results["sets"][part]["comparisons"] if (c["a"], c["b"]) == ("distilled", "student")]
        difference = pair["ce_per_byte"]
        assert difference["difference"] == pytest.approx(rows["distilled"][key] - rows["student"][key], abs=1e-6)
        if results["sets"][part]["documents"] > 1:
            assert difference["low"] <= difference["difference"] <= difference["high"]
        else:  # one document: no bootstrap interval
            assert difference["low"] is difference["high"] is None
        assert f"[{part}] distilled - student: ce {pair['ce']['difference']:+.4f}" in printed
    # --tasks: every model (the trimmed-vocabulary students in their own tokens) on the three offline lm-eval tasks
    scores = results["lm_eval"]["scores"]
    assert list(scores) == names and results["lm_eval"]["limit"] == 2
    for name in names:
        assert rows[name]["lm_eval"] == scores[name]
        assert set(scores[name]) == {"nnx_stdlib_next_line", "nnx_pydoc_perplexity", "nnx_stdlib_complete"}
        assert 0 <= scores[name]["nnx_stdlib_next_line"]["acc"]["value"] <= 1
        assert scores[name]["nnx_stdlib_next_line"]["acc"]["stderr"] is not None
        assert scores[name]["nnx_pydoc_perplexity"]["bits_per_byte"]["value"] > 0
    assert re.search(r"scored through nnx-surgery's lm-eval backend in \d+ s \(value ± standard error\)", printed)
    assert list(results["lm_eval"]["seconds"]) == names and all(s > 0 for s in results["lm_eval"]["seconds"].values())
    assert "| model | nnx_pydoc_perplexity bits_per_byte |" in printed  # the table, a column per task and metric
    with open(os.path.join(out, "lm_eval.md")) as f:
        assert "| distilled |" in f.read()


# ------------------------------------------------------------------------------------------------ the Hub
def test_push_uploads_the_folder_and_never_shows_the_token(workspace, tmp_path):
    home = tmp_path / "hf_home"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFF"))}
    with FakeHub({TOKEN: ("alice", [])}, lifetime_s=240) as hub:
        hub_env = {**base, "JAX_PLATFORMS": "cpu", "HF_ENDPOINT": hub.url, "HF_HOME": str(home),
               "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "CLI_HUB_TOKEN": TOKEN}
        pushed = nnx_surgery(hub_env, "push", workspace["student"], "alice/cli-student", "--token-env",
                             "CLI_HUB_TOKEN")
        unset = nnx_surgery(hub_env, "push", workspace["student"], "alice/cli-student", "--token-env",
                            "NO_SUCH_VARIABLE")
        assert not hub.unhandled, hub.unhandled
        repo = hub.repos["alice/cli-student"]
        tree = repo.commits[repo.branches["main"]]
        lfs = dict(hub.lfs)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert "alice/cli-student" in pushed.stdout and repo.private  # private unless --public
    with open(os.path.join(workspace["student"], "config.json"), "rb") as f:
        assert tree["config.json"].content == f.read()
    with open(os.path.join(workspace["student"], "model.safetensors"), "rb") as f:
        weights = f.read()
    assert lfs[tree["model.safetensors"].sha256] == weights
    assert {"tokenizer.json", "plan.json"} <= set(tree)
    assert_one_line_refusal(unset.returncode, unset.stderr, "--token-env NO_SUCH_VARIABLE")
    for output in (pushed, unset):
        assert TOKEN not in output.stdout + output.stderr
    for folder in (home, workspace["student"]):
        for path in (os.path.join(d, name) for d, _, names in os.walk(folder) for name in names):
            with open(path, "rb") as f:
                assert TOKEN.encode() not in f.read(), path


# ------------------------------------------------------------------------------------------------ refusals
def bad_inputs(w: dict) -> list[tuple[list[str], str]]:
    """(argv, what the one line must name): a missing or unusable path, or a bad flag, for every subcommand."""
    missing = str(w["base"] / "missing")
    return [
        (["frobnicate"], "frobnicate"),
        (["plan", missing, "--student", SPEC, "-o", missing], "TEACHER"),
        (["plan", w["teacher"], "--student", "layers=9", "-o", missing], "num_layers"),
        (["plan", w["teacher"], "--student", SPEC, "-o", missing, "--seq-len", "1"], "--seq-len"),
        (["plan", w["teacher"], "--student", SPEC, "-o", w["plan"]], "--overwrite"),
        (["plan", w["teacher"], "-o", missing], "--student"),
        (["prune", w["teacher"], missing, missing], "PLAN.json"),
        (["prune", w["teacher"], w["plan"], w["student"]], "--overwrite"),
        (["prune", w["student"], w["plan"], missing], "different teacher"),
        (["distill", w["teacher"], missing, "-o", missing], "STUDENT"),
        (["distill", w["teacher"], w["student"], "-o", missing, "--alpha", "1.5"], "--alpha"),
        (["distill", w["teacher"], w["student"], "-o", missing, "--steps", "0"], "--steps"),
        (["eval", w["student"], "-o", missing], "--teacher"),
        (["eval", "--teacher", w["teacher"], missing, "-o", missing], "FOLDER"),
        (["eval", "--teacher", w["teacher"], w["student"], "-o", missing, "--compare", "student:nobody"], "--compare"),
        (["generate", missing, "--prompt", "x"], "FOLDER"),
        (["generate", w["data"], "--prompt", "x"], "config.json"),
        (["generate", w["student"], "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["import-gguf", missing + ".gguf", missing], "FILE.gguf"),
        (["import-gguf", os.path.join(w["teacher"], "config.json"), missing], "config.json"),
        (["export-gguf", w["teacher"], missing + ".gguf", "--gguf-type", "q4_k_m"], "--gguf-type"),
        (["export-gguf", missing, missing + ".gguf"], "FOLDER"),
        (["push", missing, "alice/x"], missing),
        (["push", w["student"], "alice/x", "--public", "--private"], "--private"),  # a contradiction, refused
    ]


def test_every_refusal_is_one_line_and_exit_2(workspace, env):
    for argv, culprit in bad_inputs(workspace):
        code, _, err = run(*argv)
        assert_one_line_refusal(code, err, culprit)
    assert not os.path.exists(workspace["base"] / "missing")  # nothing was written
    debug = nnx_surgery(env, "generate", str(workspace["base"] / "missing"), "--prompt", "x", "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "FOLDER" in debug.stderr
