"""The command line under bad input (issue 43): every case refuses with exit 2 and one error line (no traceback
without --debug), writes nothing anywhere in the workspace, leaves every input byte-identical (sha256 of every
file before and after) and prints no secret; a documented reading (--truncate-prompt, --overwrite onto an output
that is no input) exits 0 and says what it did.

The classes: --overwrite onto an input, into one, around one or onto a device, or where the user stands; values a
flag cannot take (infinite, NaN, out of range, not UTF-8); requests larger than the model's positions; a full disk
(RLIMIT_FSIZE, in a subprocess); a token given where a variable's name belongs; signals during a write; settings
accepted before though wrong; compress's parser; --push-to-hub checked before training (GGUF headers that make no
sense: tests/commands/test_refusals_gguf.py). Commands run in this process (`cli.main`) unless the process itself is what is
checked (a resource limit, a signal)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from fake_hub import FakeHub
from refusal_env import (DATA, FULL_DISK, ROOT, SPEC, TOKEN, assert_refused, cli, make_workspace, refused, run,
                         tree)


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The tiny teacher with a tokenizer (128 positions), a data folder, a data-free plan, its student, the
    teacher as GGUF, a link to the teacher and an empty file; the GGUF cache outside the workspace."""
    base = tmp_path_factory.mktemp("refusals")
    cache, saved = tmp_path_factory.mktemp("gguf-cache"), os.environ.get("NNX_SURGERY_CACHE")
    w = make_workspace(base, cache)
    yield w
    if saved is None:
        os.environ.pop("NNX_SURGERY_CACHE", None)
    else:
        os.environ["NNX_SURGERY_CACHE"] = saved


# ------------------------------------------------------------------------------------------------ the table
def overwrite_cases(w: dict) -> list[tuple[list[str], str]]:
    """--overwrite onto an input, into one, around one (through a link too), or onto a device."""
    t, s, g, p, base = w["teacher"], w["student"], w["gguf"], w["plan"], str(w["base"])
    weights, linked = os.path.join(t, "model.safetensors"), os.path.join(w["link"], "model.safetensors")
    o = "--overwrite"
    return [
        (["export-gguf", t, weights, o], "lies inside the input"),
        (["export-gguf", t, os.path.join(t, "config.json"), o], "lies inside the input"),
        (["export-gguf", t, linked, o], "lies inside the input"),
        (["export-gguf", w["link"], weights, o], "lies inside the input"),
        (["export-gguf", t, os.path.join(t, "new.gguf")], "lies inside the input"),
        (["export-gguf", t, os.devnull, o], "not a regular file"),
        (["export-gguf", t, base, o], "contains the input"),
        (["import-gguf", g, base, o], "contains the input"),
        (["import-gguf", g, g, o], "is the input"),
        (["import-gguf", g, os.devnull, o], "not a regular file"),
        (["prune", t, p, t, o], "is the input"),
        (["prune", t, p, w["link"], o], "is the input"),
        (["prune", t, p, os.path.join(t, "sub"), o], "lies inside the input"),
        (["prune", t, p, base, o], "contains the input"),
        (["prune", t, p, p, o], "is the input"),
        (["prune", t, p, os.devnull, o], "not a regular file"),
        (["plan", t, "--student", SPEC, "--calibration-samples", "0", "-o", os.path.join(t, "plan.json")],
         "lies inside the input"),
        (["plan", t, "--student", SPEC, "--calibration-samples", "0", "-o", os.path.join(t, "config.json"), o],
         "lies inside the input"),
        (["plan", t, "--student", SPEC, "--data", w["data"], "-o", os.path.join(w["data"], "bisect.py"), o],
         "lies inside the input"),
        (["plan", t, "--student", SPEC, "--calibration-samples", "0", "-o", os.devnull, o], "not a regular file"),
        (["distill", t, s, "-o", t, o], "is the input"),
        (["distill", t, s, "-o", s, o], "is the input"),
        (["distill", t, s, "-o", os.path.join(s, "out"), o], "lies inside the input"),
        (["distill", t, s, "-o", base, o], "contains the input"),
        (["distill", t, s, "-o", w["data"], "--data", w["data"], o], "is the input"),
        (["distill", t, s, "-o", w["link"], o], "is the input"),
        (["distill", t, s, "-o", os.devnull, o], "not a regular file"),
        (["eval", "--teacher", t, s, "-o", s, o], "is the input"),
        (["eval", "--teacher", t, s, "-o", os.path.join(t, "eval"), o], "lies inside the input"),
        (["eval", "--teacher", t, s, "-o", base, o], "contains the input"),
        (["eval", "--teacher", g, s, "-o", g, o], "is the input"),
        (["compress", "--teacher", t, "--output", t, o, "--dry-run"], "is the input"),
        (["compress", "--teacher", t, "--output", base, o], "contains the input"),
        (["compress", "--teacher", t, "--output", os.path.join(t, "run"), o], "lies inside the input"),
        (["compress", "--teacher", t, "--data", w["data"], "--output", w["data"], o], "is the input"),
    ]


def value_cases(w: dict) -> list[tuple[list[str], str]]:
    """Values a flag cannot take: infinite, NaN, out of range, not UTF-8, more than the model's positions."""
    t, s, new = w["teacher"], w["student"], w["new"]
    distill = ["distill", t, s, "-o", new]
    cases = []
    for value in ("inf", "-inf", "nan", "1e999", "Infinity"):
        cases += [(["generate", s, "--prompt", "x", "--sample-temperature", value], "--sample-temperature"),
                  ([*distill, "--temperature", value], "--temperature"),
                  ([*distill, "--learning-rate", value], "--learning-rate"),
                  (["compress", "--teacher", t, "--output", new, "--learning-rate", value], "--learning-rate"),
                  (["compress", "--teacher", t, "--output", new, "--temperature", value], "--temperature")]
    cases += [
        ([*distill, "--alpha", "nan"], "--alpha"),
        (["generate", s, "--prompt", "x", "--sample-top-p", "nan"], "--sample-top-p"),
        (["generate", s, "--prompt", "x", "--top-k", "4"], "renamed --sample-top-k"),
        (["eval", "--teacher", t, s, "-o", new, "--tasks", "nnx_offline"], "renamed --eval-tasks"),
        (["cache-teacher", t, "--top-k", "4", "-o", new, "--student", s], "renamed --student-folder"),
        (["cache-teacher", t, "--top-k", "4", "-o", new, "--selection", "sampled"], "renamed --cache-selection"),
        ([*distill, "--teacher-cache", new], "renamed --teacher-cache-folder"),
        (["push", s, "me/x", "--revision", "dev"], "renamed --branch"),
        (["export-gguf", t, new + ".gguf", "--dtype", "f16"], "export-gguf --dtype: renamed --gguf-type"),
        (["export-gguf", t, new + ".gguf", "--dtype=q8_0"], "renamed --gguf-type"),
        (["compress", "--teacher", t, "--output", new, "--set", "training.steps=0"], "--steps 0"),
        (["compress", "--teacher", t, "--output", new, "--temperature", "3:inf"], "--temperature"),
        (["compress", "--teacher", t, "--output", new, "--temperature", "nan:1"], "--temperature"),
        (["generate", s, "--prompt", "caf\udce9 \udcff"], "UTF-8"),
        (["generate", s, "--prompt", "\udc80"], "UTF-8"),
        (["generate", s, "--prompt", "x", "--max-new-tokens", "1000000000"], "--max-new-tokens"),
        (["generate", s, "--prompt", "x", "--max-new-tokens", "128"], "--max-new-tokens"),
        (["generate", s, "--prompt", "x", "--max-new-tokens", str(10 ** 30)], "--max-new-tokens"),
        (["generate", s, "--prompt", "def f(x): return x\n" * 60], "--truncate-prompt"),
        (["generate", s, "--prompt", "word " * 200, "--max-new-tokens", "100"], "--truncate-prompt"),
    ]
    return cases


def accepted_though_wrong_cases(w: dict) -> list[tuple[list[str], str]]:
    """Settings once accepted (or blamed on another flag), refused now, before anything is written."""
    t, s, new = w["teacher"], w["student"], w["new"]
    compress = ["compress", "--teacher", t, "--output", new]
    return [
        (["eval", "--teacher", t, s, "-o", new, "--eval-tokens", "10"], "--eval-tokens"),
        (["eval", "--teacher", t, s, "-o", new, "--eval-tokens", "63"], "--eval-tokens"),
        ([*compress, "--eval-tokens", "10"], "--eval-tokens"),
        ([*compress, "--new-tokens", str(10 ** 6)], "--new-tokens"),
        (["distill", t, s, "-o", new, "--warmup-steps", "1000", "--steps", "2"], "--warmup-steps"),
        (["distill", t, s, "-o", new, "--warmup-steps", "3", "--steps", "2"], "--warmup-steps"),
        ([*compress, "--warmup-steps", "1000", "--steps", "2"], "--warmup-steps"),
        ([*compress, "--steps", "0"], "--steps 0"),
        ([*compress, "--steps", "-3", "--alpha", "0.5"], "--steps -3"),
        ([*compress, "--alpha", "1.5"], "--alpha"),
        ([*compress, "--student", "params=2.0"], "at most 1"),
        ([*compress, "--student", "params=1.5"], "at most 1"),
        ([*compress, "--student", "params=12.5"], "at most 1"),
        ([*compress, "--student", "params=lots"], "params"),
        (["compress", "--teacher", t, "--output", new, "--no-such-flag"], "--no-such-flag"),
        (["compress", "--teacher", t, "--output", new, "--steps", "many"], "--steps"),
        (["compress", "--output", new, "--preset", "tiny", "--halt-after", "x"], "--halt-after"),
        (["distill", t, s, "-o", new, "--data", w["data"]], "lower --seq-len to at most 128"),
        (["plan", t, "--student", SPEC, "--data", w["data"], "--seq-len", "4096", "-o", new], "--seq-len"),
        ([*compress, "--seq-len", "1"], "--seq-len"),
        ([*compress, "--batch-size", "0"], "--batch-size"),
        ([*compress, "--mesh", "fsdp=x"], "--mesh"),
        ([*compress, "--mesh", "tp=0"], "--mesh"),
        ([*compress, "--mesh", "fsdp=64"], "--mesh"),
        ([*compress, "--data", w["empty"]], "--data"),
        (["plan", t, "--student", "layers=1,layers=2", "-o", new], "given twice"),
        ([*compress, "--set", 'stages=[{"steps": 1e400}]'], "steps"),
        ([*compress, "--set", 'stages=[{"steps": "nan"}]'], "steps"),
        *[([*compress, "--set", f"{key}={value}"], culprit) for key, value, culprit in (
            ("optimizer.b1", "NaN", "b1=nan"), ("optimizer.eps", "-1", "eps=-1"),
            ("optimizer.clip_norm", "Infinity", "--clip-norm inf"), ("checkpoint.every", "0", "--checkpoint-every 0"),
            ("guard.window", "Infinity", "window=inf"), ("guard.lr_backoff", "2", "lr_backoff=2"),
            ("guard.spike_factor", "0.5", "spike_factor=0.5"), ("grad_accum", "1e400", "--grad-accum inf"),
            ("eval_batches", "NaN", "eval_batches"))],
        *[([*compress, flag, value], flag) for flag, value in (
            ("--kv-warmup", "nan"), ("--stage-a-fraction", "1.5"), ("--top-k", "0"), ("--eval-every", "0"),
            ("--eval-batches", "0"), ("--feature-weight", "-1"), ("--corpus-bytes", "0"), ("--new-tokens", "0"),
            ("--choice-items", "-1"))],
        ([*compress, "--seed", "-1"], "--seed"),
        (["distill", t, s, "-o", new, "--seed", "-5"], "--seed"),
        (["plan", t, "--student", SPEC, "--seed", str(2 ** 70), "-o", new], "--seed"),
        (["generate", s, "--prompt", "x", "--seed", str(2 ** 70)], "--seed"),
        (["eval", "--teacher", t, s, "-o", new, "--new-tokens", "1000000000"], "--new-tokens"),
        (["eval", "--teacher", t, s, "-o", new, "--new-tokens", "128"], "--new-tokens"),
        ([*compress, "--data", os.path.join(w["data"], "*.none")], "--data"),
    ]


def written_on_refusal_cases(w: dict) -> list[tuple[list[str], str]]:
    """A refusal after the output's path was read must not have made its folders."""
    t, new = w["teacher"], w["new"]
    nested = os.path.join(new, "sub", "x")
    return [
        (["export-gguf", str(w["base"] / "missing"), nested + ".gguf"], "FOLDER"),
        (["export-gguf", w["data"], nested + ".gguf"], "config.json"),
        (["export-gguf", t, nested + ".gguf", "--gguf-type", "q4_k_m"], "--gguf-type"),
        (["import-gguf", w["empty"], nested], "not a GGUF file"),
        (["import-gguf", os.path.join(t, "config.json"), nested], "not a GGUF file"),
        (["plan", t, "--student", "layers=99", "-o", nested + ".json"], "--student"),
        (["plan", t, "--student", "params=0.5", "-o", nested + ".json"], "params="),
        (["prune", t, str(w["base"] / "missing.json"), nested], "PLAN.json"),
        (["prune", t, w["empty"], nested], "empty.txt"),
        (["distill", t, w["student"], "-o", nested, "--data", w["empty"], *DATA], "empty.txt"),
        (["eval", "--teacher", t, w["student"], "-o", nested, "--compare", "a:b"], "--compare"),
        (["import-gguf", w["gguf"], w["student"]], "--overwrite"),
        (["plan", t, "--student", SPEC, "--calibration-samples", "0", "-o", ""], "empty path"),
        (["export-gguf", t, " "], "empty path"),
        (["prune", t, w["plan"], ""], "empty path"),
        (["export-gguf", t, os.path.join(w["plan"], "x.gguf")], "is a file, not a folder"),
        (["compress", "--teacher", t, "--student", SPEC, "--data", _one_line(w), "--seq-len", "64", "--output",
          nested], "row(s)"),
    ]


def _one_line(w: dict) -> str:
    """Text the early checks pass (a file with text in it) but too short for one row: refused once it is read."""
    path = os.path.join(w["base"], "one_line.py")
    with open(path, "w") as handle:
        handle.write("x = 1\n")
    return path


def secret_cases(w: dict) -> list[tuple[list[str], str]]:
    """A token given where the name of its variable belongs is never shown."""
    s = w["student"]
    return [
        (["push", s, "alice/x", "--token-env", TOKEN], "looks like a token"),
        (["push", s, "alice/x", f"--token-env={TOKEN}"], "looks like a token"),
        (["push", s, "alice/x", "--token-env", "Bearer " + TOKEN], "looks like a token"),
        (["push", s, "alice/x", "--token-env", TOKEN[3:]], "looks like a token"),
        (["push", s, "alice/x", "--token-env", "api_org_" + TOKEN[3:]], "looks like a token"),
        (["push", str(w["base"] / TOKEN), "alice/x", "--token-env", TOKEN], "looks like a token"),
    ]


TABLES = {"overwrite": overwrite_cases, "value": value_cases, "accepted": accepted_though_wrong_cases,
          "written": written_on_refusal_cases, "secret": secret_cases}
COUNTS = {"overwrite": 35, "value": 45, "accepted": 53, "written": 17, "secret": 6}


@pytest.mark.parametrize("table,index", [(name, i) for name, count in COUNTS.items() for i in range(count)])
def test_refusal(w, table, index):
    cases = TABLES[table](w)
    assert len(cases) == COUNTS[table], f"COUNTS[{table!r}] is {COUNTS[table]}, the table has {len(cases)}"
    argv, culprit = cases[index]
    refused(w, argv, culprit)
    assert not os.path.lexists(w["new"])
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # the device is still a device


def test_an_output_folder_is_never_where_the_user_stands(w, tmp_path, monkeypatch):
    """An empty --output, `.` or a folder above the current one would be the current folder (or hold it), which
    --overwrite deletes: refused, whatever the command. Run from a folder of this test's own, with a canary."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "canary.txt").write_text("still here")
    monkeypatch.chdir(here)
    t, s, o = w["teacher"], w["student"], "--overwrite"
    for argv in (["compress", "--teacher", t, "--output", "", o], ["compress", "--teacher", t, "--output", ".", o],
                 ["compress", "--teacher", t, "--output", "..", o], ["distill", t, s, "-o", ".", o],
                 ["distill", t, s, "-o", "..", o], ["prune", t, w["plan"], ".", o], ["import-gguf", w["gguf"], ".", o],
                 ["eval", "--teacher", t, s, "-o", "..", o]):
        err = refused(w, argv)
        assert "empty path" in err or "holds the current folder" in err, err
    assert os.listdir(here) == ["canary.txt"]


def test_a_run_may_read_its_settings_from_its_own_folder(w, tmp_path):
    """`--config RUN/resolved_config.json --output RUN` (how a run is repeated or resumed) is no output onto an
    input: the file is read whole before anything is written, so the settings resolve."""
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "resolved_config.json").write_text(json.dumps({"steps": 3}))
    from nnx_surgery.recipes.compress.resolution import resolve

    config = resolve(["--config", str(run_folder / "resolved_config.json"), "--output", str(run_folder),
                      "--teacher", w["teacher"], "--overwrite"])
    assert config.training.steps == 3 and config.run.output == str(run_folder)


def test_debug_keeps_the_traceback(w):
    code, _, err = run("export-gguf", w["teacher"], os.path.join(w["teacher"], "x.gguf"), "--debug")
    assert code == 2 and "Traceback" in err and "lies inside the input" in err


def test_secret_variables_are_masked_in_any_message(w, monkeypatch):
    """A secret-bearing variable's value never appears, even where the message would echo a path equal to it."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    err = refused(w, ["push", str(w["base"] / TOKEN), "alice/x"])
    assert "<secret>" in err
    err = refused(w, ["generate", str(w["base"] / TOKEN), "--prompt", "x"], "FOLDER")
    assert "<secret>" in err


# ------------------------------------------------------------------------------------------------ readings
def test_truncate_prompt_keeps_the_last_tokens_and_says_so(w):
    code, out, err = run("generate", w["student"], "--prompt", "word " * 200, "--max-new-tokens", "4",
                         "--truncate-prompt")
    assert code == 0, err
    assert "--truncate-prompt kept the prompt's last" in err and "Traceback" not in err and out.strip() != ""


def test_import_gguf_overwrite_replaces_an_output_that_is_no_input(w, tmp_path):
    out = tmp_path / "imported"
    out.mkdir()
    (out / "old.txt").write_text("old")
    before = tree(w["base"])
    code, _, err = run("import-gguf", w["gguf"], str(out), "--dtype", "float32", "--overwrite")
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json", "special_tokens_map.json",
                                              "generation_config.json"])
    assert tree(w["base"]) == before


def test_the_push_example_names_the_command_once():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(["push", "--help"])
    examples = out.getvalue().split("examples:")[1].strip().splitlines()
    assert examples and all(line.count("nnx-surgery") == 1 for line in examples), examples


# ------------------------------------------------------------------------------------------------ interruptions
def test_interrupted_writes_leave_nothing_and_never_offer_resume(w, monkeypatch):
    """Ctrl-C inside export-gguf's and import-gguf's writes, distill's training and push's upload: exit 130, no
    temporary left, and no --resume (these commands have none) nor Python-API advice."""
    from nnx_surgery import distill, export
    from nnx_surgery.distill.interruption import RunInterrupted, interruption_message
    from nnx_surgery.surgery.storage import gguf_import
    from nnx_surgery.export import gguf_export

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    def stop_run(*args, **kwargs):
        raise RunInterrupted(interruption_message("SIGINT", 1, 2, saved=False, directory=None, checkpoint_step=None),
                             step=1, checkpoint_step=None, directory=None)

    new = w["new"]
    for module, name, argv in ((gguf_export, "write_gguf", ["export-gguf", w["teacher"], new + ".gguf"]),
                               (gguf_import, "write_model_files", ["import-gguf", w["gguf"], new]),
                               (distill, "run", ["distill", w["teacher"], w["student"], "-o", new, *DATA,
                                                 "--data", w["data"]]),
                               (export, "push_to_hub", ["push", w["student"], "alice/x"])):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, stop_run if name == "run" else stop)
            before = tree(w["base"])
            code, _, err = run(*argv)
        assert code == 130, err
        assert "--resume" not in err and "checkpoint.directory" not in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and "run the same command again" in err
        assert tree(w["base"]) == before, name


def test_ctrl_c_in_distills_final_save_offers_no_resume(w, monkeypatch):
    """The training done (here: a run that returns at once), Ctrl-C while the student is saved."""
    from types import SimpleNamespace

    from nnx_surgery import distill, surgery

    def trained(teacher, student, data, config):
        return SimpleNamespace(student=student, full_history=[], full_evals=[], data_state={})

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "run", trained)
    monkeypatch.setattr(surgery, "save_student", stop)
    monkeypatch.setattr(surgery, "save_pretrained", stop)
    before = tree(w["base"])
    code, _, err = run("distill", w["teacher"], w["student"], "-o", w["new"], *DATA, "--data", w["data"])
    assert code == 130 and err.strip().splitlines()[-1].startswith("interrupted; nothing was written"), err
    assert "--resume" not in err and "Traceback" not in err
    assert tree(w["base"]) == before


SIGNALLED = """
import os, signal, sys
from nnx_surgery import cli
from nnx_surgery.export import gguf_export
def write(tmp, *args):
    with open(tmp, "wb") as handle:
        handle.write(b"GGUF partial")
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
gguf_export.write_gguf = write
sys.exit(cli.main(["export-gguf", *sys.argv[2:]]))
"""


def test_sigterm_and_sigkill_during_export_leave_no_temporary_behind(w, tmp_path):
    """SIGTERM: the temporary is removed on the way out (exit 143, one line). SIGKILL cannot be caught: its
    temporary is named after the dead writer, and the next export to the same path removes it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = tmp_path / "x.gguf"
    term = subprocess.run([sys.executable, "-c", SIGNALLED, "SIGTERM", w["teacher"], str(out)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert term.returncode == 143, term.stderr
    assert "Traceback" not in term.stderr and len(term.stderr.strip().splitlines()) == 1, term.stderr
    assert term.stderr.startswith("terminated (SIGTERM); nothing was written") and "--resume" not in term.stderr
    assert os.listdir(tmp_path) == []
    kill = subprocess.run([sys.executable, "-c", SIGNALLED, "SIGKILL", w["teacher"], str(out)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert kill.returncode == -signal.SIGKILL
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".x.gguf.partial-")
    code, _, err = run("export-gguf", w["teacher"], str(out), "--gguf-type", "f16")
    assert code == 0, err
    assert os.listdir(tmp_path) == ["x.gguf"]


# ------------------------------------------------------------------------------------------------ a full disk


def test_a_full_disk_is_one_line_and_leaves_nothing(w, tmp_path):
    """Every write past the file size limit (RLIMIT_FSIZE 0, as `ulimit -f 0`) fails with EFBIG, as a full disk
    fails with ENOSPC: every command that writes (export-gguf, import-gguf, prune, plan, distill, eval) refuses in
    one line and leaves no file."""
    out = tmp_path / "out"
    commands = [["export-gguf", w["teacher"], str(out / "x.gguf")], ["import-gguf", w["gguf"], str(out / "hf")],
                ["prune", w["teacher"], w["plan"], str(out / "student")],
                ["plan", w["teacher"], "--student", SPEC, "--calibration-samples", "0", "-o", str(out / "p.json")],
                ["distill", w["teacher"], w["student"], "-o", str(out / "distilled"), "--data", w["data"], *DATA,
                 "--steps", "1", "--batch-size", "1"],
                ["eval", "--teacher", w["teacher"], w["student"], "-o", str(out / "eval"), "--data", w["data"], *DATA,
                 "--eval-tokens", "64", "--eval-prompts", "1", "--new-tokens", "2", "--choice-items", "1",
                 "--no-general-eval"]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "PYTHONDONTWRITEBYTECODE": "1"}
    before = tree(w["base"])
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, json.dumps([[0, argv] for argv in commands])], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for argv, (code, err) in zip(commands, json.loads(proc.stdout.strip().splitlines()[-1])):
        assert_refused(code, "", err, "", started=argv[0] in ("distill", "eval"))
        assert "full" in err or "File too large" in err, (argv, err)
    leftovers = [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names]
    assert leftovers == [], leftovers
    assert tree(w["base"]) == before


# ------------------------------------------------------------------------------------------------ --push-to-hub
def test_push_to_hub_is_checked_before_the_run(w, tmp_path, monkeypatch):
    """compress --push-to-hub refuses at once, writing nothing, when offline, without a token, or with a token that
    cannot write to the namespace (the local fake Hub; huggingface_hub's settings patched as its variables set
    them)."""
    from huggingface_hub import constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    out = str(w["base"] / "run")
    with FakeHub({TOKEN: ("alice", [])}, lifetime_s=120) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        cases = [(True, TOKEN, "alice/run", "offline"), (False, None, "alice/run", "no Hugging Face token"),
                 (False, TOKEN, "bob/run", "cannot write to namespace 'bob'")]
        for offline, token, repo, culprit in cases:
            with monkeypatch.context() as patch:
                patch.setattr(constants, "HF_HUB_OFFLINE", offline)
                if token:
                    patch.setenv("HF_TOKEN", token)
                refused(w, ["compress", "--preset", "tiny", "--output", out, "--push-to-hub", repo], culprit)
        assert not hub.repos  # nothing created on the Hub either
