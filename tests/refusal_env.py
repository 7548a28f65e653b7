"""What the refusal tests share (tests/commands/test_refusals.py, tests/commands/test_refusals_gguf.py): running `nnx-surgery` in
this process, a workspace's fingerprint (every file's sha256), and the check every refusal must pass: exit 2, one
error line, no traceback, nothing written, every input byte-identical, no token in the output."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nnx_surgery import cli  # noqa: E402

TOKEN = "hf_refusalCanaryQ7zX9wV3tT5rR1pP8nN2"
SPEC = "layers=2,mlp=24"
DATA = ["--seq-len", "32"]


def make_workspace(base, cache) -> dict:
    """The tiny teacher with a tokenizer (128 positions, 767 pieces) in `base`, a data folder, a data-free plan,
    its student, the teacher as GGUF, a link to the teacher and an empty file; `cache`: NNX_SURGERY_CACHE (set
    here; the caller puts it back), outside the workspace."""
    import shutil
    import sysconfig

    from hf_reference import make_hf_model, save_hf
    from tiny_tokenizers import save_gemma_tokenizer

    teacher, data = str(base / "teacher"), base / "data"
    size = save_gemma_tokenizer(teacher)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size, query_pre_attn_scalar=12,
                          num_hidden_layers=2), teacher)
    data.mkdir()
    for name in ("textwrap.py", "string.py", "bisect.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), data)
    os.environ["NNX_SURGERY_CACHE"] = str(cache)
    w = dict(base=base, teacher=teacher, data=str(data), plan=str(base / "plan.json"), student=str(base / "student"),
             gguf=str(base / "teacher.gguf"), link=str(base / "link"), empty=str(base / "empty.txt"),
             cache=str(cache / "gguf"), new=str(base / "new"))
    assert run("plan", teacher, "--student", SPEC, "--calibration-samples", "0", "-o", w["plan"])[0] == 0
    assert run("prune", teacher, w["plan"], w["student"])[0] == 0
    assert run("export-gguf", teacher, w["gguf"], "--gguf-type", "f32")[0] == 0
    os.symlink(teacher, w["link"])
    open(w["empty"], "w").close()
    return w


def run(*args: str) -> tuple[int, str, str]:
    """`nnx-surgery ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def tree(root) -> dict[str, str]:
    """Every entry under `root`: a file's sha256, a link's target, a folder's name (so a new empty one shows)."""
    found = {}
    for base, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(base, name)
            key = os.path.relpath(path, root)
            if os.path.islink(path):
                found[key] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                found[key] = "folder"
            else:
                with open(path, "rb") as handle:
                    found[key] = hashlib.sha256(handle.read()).hexdigest()
    return found


def assert_refused(code, out: str, err: str, culprit: str = "", *, expected: int = 2, started: bool = False) -> None:
    """Exit `expected`, one error line naming `culprit`, no traceback, no token. `started`: the command had begun
    its work (a progress bar may precede the error), else the error and the pointer to --debug are all of stderr."""
    assert code == expected, f"exit {code}, not {expected}:\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err and "Traceback" not in out, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    lines = err.strip().splitlines()
    assert len(lines) <= 2 or (started and lines[-2] == errors[0]), err
    assert culprit in errors[0], f"{culprit!r} not in {errors[0]!r}"
    assert TOKEN not in out + err


def refused(w: dict, argv: list[str], culprit: str = "", *, expected: int = 2) -> str:
    """Run `argv` in this process; check the refusal and that nothing in the workspace changed."""
    before = tree(w["base"])
    code, out, err = run(*argv)
    assert_refused(code, out, err, culprit, expected=expected)
    assert tree(w["base"]) == before, "the workspace changed"
    assert not os.path.exists(w["cache"]) or not [n for n in os.listdir(w["cache"]) if n.startswith(".")]
    return err


# Run `cli.main` on each [file size limit (RLIMIT_FSIZE, as `ulimit -f`), argv] of argv[1] (JSON) in one process:
# [[exit code, stderr], ...] as JSON on stdout.
FULL_DISK = """
import contextlib, io, json, resource, sys
from nnx_surgery import cli
results = []
for limit, argv in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""
