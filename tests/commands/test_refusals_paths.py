"""The command line under bad input, second round (issue 63): what a command reads and writes. Every case refuses
with exit 2 and one error line (no traceback), writes nothing, leaves every input byte-identical and prints no
secret (tests/refusal_env.py's `refused`), run in this process.

The cases are made from declarations, so that a new command or flag is covered by adding it to one:
`WRITERS` (every command that writes, called with OUT as its output) and `READERS` (every place a model folder is
read, called with FOLDER there). The classes: an input inside the output (--cache-dir, --teacher-cache, --student,
--data), a symlink as the output (dangling, a loop, or to a file or folder elsewhere), outputs the file system
refuses (below a regular file, a name over 255 bytes, a read-only place), model folders with a broken config.json
or tokenizer.json (or no positions), a path of the wrong kind (a file for a folder, a folder or a pipe for a
file), a mistyped relative folder (no such local folder, and not on the Hub), abbreviated flags, values found out
of range only at run time, and secrets in paths (with --debug too)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from refusal_env import DATA, SPEC, TOKEN, make_workspace, refused, run, tree

TOP = ["--top-k", "4"]
# every command that writes: its command line with OUT as its output
WRITERS = {
    "plan": lambda w, out: ["plan", w["teacher"], "--student", SPEC, "--calibration-samples", "0", "-o", out],
    "prune": lambda w, out: ["prune", w["teacher"], w["plan"], out],
    "distill": lambda w, out: ["distill", w["teacher"], w["student"], "-o", out, *DATA, "--data", w["data"]],
    "eval": lambda w, out: ["eval", "--teacher", w["teacher"], w["student"], "-o", out, *DATA, "--data", w["data"]],
    "cache-teacher": lambda w, out: ["cache-teacher", w["teacher"], *TOP, "-o", out, *DATA, "--data", w["data"]],
    "import-gguf": lambda w, out: ["import-gguf", w["gguf"], out],
    "export-gguf": lambda w, out: ["export-gguf", w["teacher"], out],
    "compress": lambda w, out: ["compress", "--teacher", w["teacher"], "--student", SPEC, "--data", w["data"], *DATA,
                                "--output", out],
}
FILE_OUTPUTS = ("plan", "export-gguf")  # the others write a folder
# every place a model folder is read: the command line with FOLDER there
READERS = {
    "generate": lambda w, f: ["generate", f, "--prompt", "x"],
    "distill STUDENT": lambda w, f: ["distill", w["teacher"], f, "-o", w["new"]],
    "distill TEACHER": lambda w, f: ["distill", f, w["student"], "-o", w["new"]],
    "eval FOLDER": lambda w, f: ["eval", "--teacher", w["teacher"], f, "-o", w["new"]],
    "eval --teacher": lambda w, f: ["eval", "--teacher", f, w["student"], "-o", w["new"]],
    "plan TEACHER": lambda w, f: ["plan", f, "--student", SPEC, "--calibration-samples", "0", "-o", w["new"]],
    "prune TEACHER": lambda w, f: ["prune", f, w["plan"], w["new"]],
    "export-gguf": lambda w, f: ["export-gguf", f, w["new"] + ".gguf"],
    "cache-teacher TEACHER": lambda w, f: ["cache-teacher", f, *TOP, "-o", w["new"]],
    "cache-teacher --student-folder": lambda w, f: ["cache-teacher", w["teacher"], "--student-folder", f, *TOP, "-o", w["new"]],
    "compress --teacher": lambda w, f: ["compress", "--teacher", f, "--output", w["new"]],
    "push": lambda w, f: ["push", f, "alice/student"],
}
# a model folder with one file broken: (file, bytes written there or a change to config.json, culprit)
BROKEN = {"config-not-json": ("config.json", b"{nope", "config.json is not valid JSON"),
          "config-empty": ("config.json", b"", "config.json is empty"),
          "config-list": ("config.json", b"[1, 2]", "holds a JSON list"),
          "tokenizer-schema": ("tokenizer.json", b'{"version": "1.0", "model": 7}',
                               "tokenizer.json is not a tokenizer"),
          "tokenizer-empty": ("tokenizer.json", b"", "tokenizer.json is empty"),
          "no-positions": ("config.json", {"max_position_embeddings": 0}, "max_position_embeddings 0")}


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """refusal_env's workspace, plus: a broken copy of the teacher per `BROKEN`, a regular file, a pipe, links
    (dangling, a loop, to a file and to a folder elsewhere), folders holding an input (a --cache-dir with a
    cached teacher, a teacher cache, a student, data), a teacher cache and a read-only folder (None where this
    machine cannot make one)."""
    base = tmp_path_factory.mktemp("refusals-paths")
    cache, saved = tmp_path_factory.mktemp("gguf-cache"), os.environ.get("NNX_SURGERY_CACHE")
    w = make_workspace(base, cache)
    for name, (file, content, _) in BROKEN.items():
        folder = base / name
        shutil.copytree(w["teacher"], folder)
        if isinstance(content, dict):
            config = json.loads((folder / file).read_text())
            (folder / file).write_text(json.dumps({**config, **content}))
        else:
            (folder / file).write_bytes(content)
        w[name] = str(folder)
    (base / "afile").write_text("a file")
    pipes = tmp_path_factory.mktemp("pipes")  # outside the workspace, whose files are read to compare them
    os.mkfifo(pipes / "pipe.gguf")
    (base / "target.bin").write_text("not to be replaced")
    (base / "target_dir").mkdir()
    os.symlink(base / "nowhere" / "x", base / "dangling")
    os.symlink(base / "loop", base / "loop")
    os.symlink(base / "target.bin", base / "to-file")
    os.symlink(base / "target_dir", base / "to-folder")
    holders = {"holds-cache": "cache/tiny-teacher-0", "holds-tc": "tc", "holds-student": "student",
               "holds-data": "data"}
    for name, inner in holders.items():
        (base / name / inner).mkdir(parents=True)
        (base / name / "old.txt").write_text("an earlier output")
        w[name] = str(base / name)
    (base / "holds-cache" / "cache" / "tiny-teacher-0" / "config.json").write_text("{}")
    (base / "holds-tc" / "tc" / "manifest.json").write_text("{}")
    shutil.copytree(w["student"], base / "holds-student" / "student", dirs_exist_ok=True)
    shutil.copy(os.path.join(w["data"], "bisect.py"), base / "holds-data" / "data")
    (base / "tc").mkdir()
    (base / "tc" / "manifest.json").write_text("{}")
    w.update(afile=str(base / "afile"), pipe=str(pipes / "pipe.gguf"), tc=str(base / "tc"), ro=_read_only(base / "ro"))
    yield w
    if w["ro"]:
        subprocess.run(["umount", w["ro"]], capture_output=True) if os.geteuid() == 0 else os.chmod(w["ro"], 0o755)
    os.environ.pop("NNX_SURGERY_CACHE", None) if saved is None else os.environ.update(NNX_SURGERY_CACHE=saved)


def _read_only(path) -> str | None:
    """A folder nothing may be written in: without write permission, or (as root, whom permissions do not stop) a
    read-only tmpfs mounted there; None when neither can be made."""
    path.mkdir()
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return str(path)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    return str(path) if made.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ the tables
def input_inside_output_cases(w: dict) -> list[tuple[list[str], str]]:
    """An output that holds, is or lies inside something the command reads, --overwrite or not."""
    o, t, s = "--overwrite", w["teacher"], w["student"]
    cached = os.path.join(w["holds-cache"], "cache")
    tiny = ["compress", "--preset", "tiny"]
    return [
        ([*tiny, "--cache-dir", cached, "--output", w["holds-cache"], o], "contains the input"),
        ([*tiny, "--cache-dir", cached, "--output", w["holds-cache"]], "contains the input"),
        ([*tiny, "--cache-dir", cached, "--output", cached, o], "is the input"),
        ([*tiny, "--cache-dir", cached, "--output", os.path.join(cached, "tiny-teacher-0")], "lies inside the input"),
        ([*tiny, "--cache-dir", cached, "--output", os.path.join(cached, "tiny-teacher-0"), o], "lies inside"),
        ([*tiny, "--cache-dir", w["afile"], "--output", w["new"]], "--cache-dir"),
        (["compress", "--teacher", t, "--feature-weight", "0", "--teacher-cache", os.path.join(w["holds-tc"], "tc"),
          "--output", w["holds-tc"], o], "contains the input"),
        (["distill", t, s, "--teacher-cache-folder", os.path.join(w["holds-tc"], "tc"), "-o", w["holds-tc"], o],
         "contains the input"),
        (["distill", t, s, "--teacher-cache-folder", w["tc"], "-o", w["tc"], o], "is the input"),
        (["distill", t, s, "--teacher-cache-folder", w["tc"], "-o", os.path.join(w["tc"], "out"), o], "lies inside"),
        (["distill", t, s, "--teacher-cache-folder", w["afile"], "-o", w["new"]], "--teacher-cache-folder"),
        (["cache-teacher", t, "--student-folder", os.path.join(w["holds-student"], "student"), *TOP, "-o",
          w["holds-student"], o], "contains the input"),
        (["cache-teacher", t, *TOP, *DATA, "--data", os.path.join(w["holds-data"], "data"), "-o", w["holds-data"],
          o], "contains the input"),
    ]


def symlink_output_cases(w: dict) -> list[tuple[list[str], str]]:
    """An output that is a symbolic link: dangling, a loop, or to a file or folder elsewhere (never replaced,
    never written through), for every command that writes."""
    base = str(w["base"])
    cases = []
    for command, argv in WRITERS.items():
        elsewhere = "to-file" if command in FILE_OUTPUTS else "to-folder"
        for link in ("dangling", "loop", elsewhere):
            cases += [(argv(w, os.path.join(base, link)) + ["--overwrite"], "is a symbolic link")]
    return cases


def refused_place_cases(w: dict) -> list[tuple[list[str], str]]:
    """Outputs the file system refuses, found before any work: below a regular file, a name over 255 bytes, a
    read-only place (skipped where none can be made)."""
    long_name = os.path.join(str(w["base"]), "n" * 256)
    cases = []
    for command, argv in WRITERS.items():
        cases += [(argv(w, os.path.join(w["afile"], "sub", "out")), "is a file, not a folder"),
                  (argv(w, long_name), "256 bytes")]
        if w["ro"]:
            cases += [(argv(w, os.path.join(w["ro"], "out")), "cannot write in")]
    return cases


def broken_folder_cases(w: dict) -> list[tuple[list[str], str]]:
    """Every place a model folder is read, given one with a broken config.json or tokenizer.json."""
    return [(argv(w, w[name]), culprit) for name, (_, _, culprit) in BROKEN.items() for argv in READERS.values()]


def wrong_kind_cases(w: dict) -> list[tuple[list[str], str]]:
    """A path that exists but is of the wrong kind is named as such, never as missing; a mistyped relative folder
    is named as neither a local folder nor on the Hub."""
    mistyped = "no-such-inputs/gteachr"
    cases = [(argv(w, w["afile"]), "is a file, not a folder") for argv in READERS.values()]
    cases += [(["import-gguf", w["student"], w["new"]], "is a folder, not a file"),
              (["import-gguf", w["pipe"], w["new"]], "not a regular file"),
              (["import-gguf", os.path.join(str(w["base"]), "dangling"), w["new"]], "symbolic link to nothing"),
              (["compress", "--config", w["student"], "--output", w["new"]], "is a folder, not a file"),
              (["compress", "--config", w["pipe"], "--output", w["new"]], "not a regular file"),
              (["compress", "--teacher", w["pipe"], "--output", w["new"]], "not a regular file")]
    cases += [(READERS[place](w, mistyped), "no such local folder, and not found on the Hub") for place in (
        "distill TEACHER", "eval --teacher", "plan TEACHER", "prune TEACHER", "cache-teacher TEACHER")]
    return cases


def flag_cases(w: dict) -> list[tuple[list[str], str]]:
    """Abbreviated flags are unknown, not read as the flag they begin; values out of range found before any
    work; a setting of a --config file named as written, not as a setting derived from it."""
    t, s, new = w["teacher"], w["student"], w["new"]
    configs = {}
    for name, values in (("nan", '{"learning_rate": NaN}'), ("negative", '{"learning_rate": -1}'),
                         ("steps", '{"steps": 1e30}')):
        configs[name] = os.path.join(str(w["base"]), f"{name}.json")
        if not os.path.exists(configs[name]):
            with open(configs[name], "w") as handle:
                handle.write(values)
    return [
        (["eval", "--teacher", t, s, "-o", new, "--task", "nnx_offline"], "unrecognized arguments: --task"),
        (["distill", t, s, "-o", new, "--step", "3"], "unrecognized arguments: --step"),
        (["plan", t, "--student", SPEC, "-o", new, "--calib", "0"], "unrecognized arguments: --calib"),
        (["generate", s, "--prompt", "x", "--max-new", "3"], "unrecognized arguments: --max-new"),
        (["cache-teacher", t, "--top", "4", "-o", new], "--top"),
        (["compress", "--teacher", t, "--output", new, "--learning", "0.1"], "unrecognized arguments: --learning"),
        ([], "give a command"),
        (["distill", t, s, "-o", new, "--top-k", "768"], "--top-k 768"),
        (["distill", t, s, "-o", new, "--steps", str(10 ** 30)], "--steps"),
        (["distill", t, s, "-o", new, "--steps", "1e30"], "--steps"),
        (["compress", "--teacher", t, "--output", new, "--steps", str(10 ** 30)], "--steps"),
        (["cache-teacher", t, "--top-k", "768", "-o", new], "--top-k 768"),
        (["compress", "--teacher", t, "--config", configs["nan"], "--output", new], "--learning-rate nan"),
        (["compress", "--teacher", t, "--config", configs["negative"], "--output", new], "--learning-rate -1"),
        (["compress", "--teacher", t, "--config", configs["steps"], "--output", new], "--steps"),
    ]


def secret_cases(w: dict) -> list[tuple[list[str], str]]:
    """A path holding the token's value ($HF_TOKEN set): every message masks it, --debug's traceback too."""
    secret = os.path.join(str(w["base"]), TOKEN)
    below = os.path.join(w["afile"], TOKEN)
    cases = [(argv(w, secret), "<secret>") for argv in READERS.values()]
    cases += [(argv(w, secret) + ["--debug"], "<secret>") for argv in READERS.values()]
    cases += [(argv(w, below), "<secret>") for argv in WRITERS.values()]
    cases += [(["generate", w["student"], "--prompt", "x", "--seed", TOKEN], "<secret>"),
              (["compress", "--teacher", w["teacher"], "--output", w["new"], "--steps", TOKEN], "<secret>")]
    return cases


TABLES = {"inputs": input_inside_output_cases, "symlink": symlink_output_cases, "place": refused_place_cases,
          "broken": broken_folder_cases, "kind": wrong_kind_cases, "flags": flag_cases, "secret": secret_cases}
COUNTS = {"inputs": 13, "symlink": 24, "place": 24, "broken": 72, "kind": 23, "flags": 15, "secret": 34}


@pytest.mark.parametrize("table,index", [(name, i) for name, count in COUNTS.items() for i in range(count)])
def test_refusal(w, table, index, monkeypatch):
    cases = TABLES[table](w)
    if table == "place" and not w["ro"]:  # no read-only folder on this machine: its 8 cases are left out
        assert len(cases) == COUNTS[table] - len(WRITERS)
        if index >= len(cases):
            pytest.skip("no read-only folder can be made here")
    else:
        assert len(cases) == COUNTS[table], f"COUNTS[{table!r}] is {COUNTS[table]}, the table has {len(cases)}"
    argv, culprit = cases[index]
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a Hub id is looked up in the local cache only
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    if "--debug" in argv:  # the traceback is asked for: masked too
        before = tree(w["base"])
        code, out, err = run(*argv)
        assert code == 2 and "Traceback" in err and culprit in err, err
        assert TOKEN not in out + err and tree(w["base"]) == before
        return
    refused(w, argv, culprit)
    assert not os.path.lexists(w["new"])


def test_names_the_file_system_allows_work(w, tmp_path):
    """Output names of 240 to 255 bytes are valid: the temporary names built from them stay within the limit."""
    outputs = {"plan": tmp_path / ("p" * 250 + ".json"), "export-gguf": tmp_path / ("e" * 245 + ".gguf"),
               "prune": tmp_path / ("s" * 255), "import-gguf": tmp_path / ("i" * 242)}
    for command, out in outputs.items():
        code, _, err = run(*WRITERS[command](w, str(out)))
        assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(out.name for out in outputs.values())  # no temporary left


def test_a_bugs_traceback_masks_the_secret(w, monkeypatch):
    """An error that is no refusal keeps its traceback (exit 1), the token masked in it."""
    from nnx_surgery import surgery

    def broken(*args, **kwargs):
        raise RuntimeError(f"a bug that shows {TOKEN}")

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(surgery, "load_pretrained", broken)
    code, out, err = run("generate", w["student"], "--prompt", "x")
    assert code == 1 and "Traceback" in err and "a bug that shows <secret>" in err and TOKEN not in out + err


def test_a_dry_run_writes_nothing_in_the_cache(w, tmp_path):
    """compress --dry-run with the tiny preset: no --cache-dir made, no --output, the temporary config gone."""
    cache = tmp_path / "cache"
    code, out, err = run("compress", "--preset", "tiny", "--dry-run", "--cache-dir", str(cache), "--output",
                         str(tmp_path / "run"))
    assert code == 0, err
    assert os.listdir(tmp_path) == []
