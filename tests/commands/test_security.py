"""Nothing in a checkpoint can run code, and Hub tokens never reach a log, an error or a file.

1. The package (surgery/, distill/, recipes/) never unpickles, never calls torch.load, never passes
   trust_remote_code, never evals or execs: checked on the syntax tree of every module, so a mention in a
   message or a comment does not count but any use does.
2. A whole publishing run (plan, student, distillation with metrics and checkpoints, model card, push, failed
   pushes) with a recognisable fake token, logging at DEBUG, against the local fake Hub: the token appears in no
   file the run wrote and nowhere in its output.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("nnx_surgery", "recipes")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load")}
UNSAFE_NAMES = {"eval", "exec"}
UNSAFE_WORDS = {"trust_remote_code", "allow_pickle", "weights_only"}


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """Each use of a way to run code from data in `source`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                ((node.value.id, node.attr) in UNSAFE_CALLS or node.value.id in UNSAFE_MODULES):
            found.append(f"{line}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in UNSAFE_NAMES | UNSAFE_WORDS:
            found.append(f"{line}: {node.id}")
        elif isinstance(node, ast.keyword) and node.arg in UNSAFE_WORDS:
            found.append(f"{line}: {node.arg}=")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in UNSAFE_WORDS:
            found.append(f"{line}: {node.value!r}")  # e.g. kwargs built as {"trust_remote_code": True}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__" and \
                node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in UNSAFE_MODULES:
            found.append(f"{line}: __import__({node.args[0].value!r})")
    return found


def package_files() -> list[str]:
    files = []
    for package in PACKAGES:
        for base, _, names in os.walk(os.path.join(ROOT, package)):
            files += [os.path.join(base, n) for n in names if n.endswith(".py")]
    return sorted(files)


def test_the_scanner_sees_every_kind_of_use():
    sample = ("import pickle\nfrom dill import loads\nimport torch\nx = torch.load('f')\neval(text)\nexec(code)\n"
              "f(trust_remote_code=True)\nkw = {'trust_remote_code': True}\nnp.load(p, allow_pickle=True)\n"
              "__import__('marshal')\nyaml.load(s)\nmodel.eval()\nmessage = 'pickled .bin files are refused'\n")
    found = unsafe_uses(sample)
    assert sorted({int(f.split(":")[0]) for f in found}) == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]


def test_package_never_runs_code_from_data():
    files = package_files()
    assert len(files) > 20 and any(f.endswith("safetensors_stream.py") for f in files)
    problems = {os.path.relpath(path, ROOT): unsafe_uses(open(path, encoding="utf-8").read(), path)
                for path in files}
    problems = {path: uses for path, uses in problems.items() if uses}
    assert not problems, f"code execution from data is possible: {problems}"


# ------------------------------------------------------------------------------------------------ token leaks
TOKEN = "hf_LEAKCANARYq7Zx9Wv3Tt5Rr1Pp8Nn2Mm4Kk6"
SCENARIO = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from huggingface_hub.utils import logging as hf_logging
hf_logging.set_verbosity_debug()
import numpy as np
sys.path.insert(0, os.path.join({root!r}, "tests"))
from hf_reference import make_hf_model, save_hf
import nnx_surgery.export.hub as hub_module
from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, LossWeights, Stage
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
from nnx_surgery.distill.loop.trainer import run
from nnx_surgery.surgery.pruning.in_memory import apply_plan, save_student
from nnx_surgery.export.model_card import write_model_card
from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained
from nnx_surgery.export.hub import HubError, push_to_hub
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.plans.student_spec import StudentSpec

hub_module.RETRY_WAIT_S = 0.01
work = sys.argv[1]
teacher_dir = save_hf(make_hf_model("gemma2", seed=1, num_hidden_layers=2, layer_types=None), work + "/teacher")
save_byte_tokenizer(teacher_dir)
teacher = load_pretrained(teacher_dir)
plan = plan_student(teacher_dir, StudentSpec(1, 24, 32, 2, 1), depth="uniform", width="magnitude")
plan.save(work + "/plan.json")
student = apply_plan(teacher, plan)
ids = np.random.default_rng(0).integers(4, 96, size=(2, 8)).astype(np.int32)
config = DistillConfig(stages=(Stage(steps=2, weights=LossWeights(kl=1.0)),), plan=plan, progress=False,
                       plots=False, run_dir=work + "/run", checkpoint=CheckpointConfig(work + "/ckpt", every=1))
result = run(teacher, student, [{{"input_ids": ids}}] * 2, config)
folder = save_student(student, plan, work + "/student", source=teacher_dir)
write_model_card(folder, teacher_id="google/gemma-2-2b", plan_summary={{"layers": "2 -> 1"}},
                 data_description="random ids", steps=2, tokens=32,
                 losses={{"kl": [r["loss"] for r in result.history]}}, evaluation={{}}, repo_id="alice/canary")
messages = []
print("pushed", push_to_hub(folder, "alice/canary"))
for repo, kwargs in (("bob/canary", {{}}), ("alice/canary", {{"endpoint": "http://127.0.0.1:9"}})):
    try:
        push_to_hub(folder, repo, **kwargs)
    except HubError as err:
        messages.append(str(err))
        print("HubError:", err)
print("RESULT " + json.dumps({{"errors": messages}}))
"""


@pytest.mark.slow
def test_hub_token_never_reaches_logs_errors_or_files(tmp_path):
    from fake_hub import FakeHub

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    with FakeHub({TOKEN: ("alice", [])}, lifetime_s=300) as hub:
        env.update(JAX_PLATFORMS="cpu", HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf_home"),
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, "-c", SCENARIO.format(root=ROOT), str(work)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        uploaded = hub.repos.get("alice/canary")
        hub_files = [hub.file_content(blob) for blob in uploaded.commits[uploaded.branches["main"]].values()] \
            if uploaded else []
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    errors = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])["errors"]
    assert len(errors) == 2 and "bob" in errors[0] and "cannot reach" in errors[1]
    assert "Authorization" in output or "whoami" in output  # DEBUG logging really ran
    assert TOKEN not in output
    written = [os.path.join(base, name) for base, _, names in os.walk(tmp_path) for name in names]
    kinds = {os.path.relpath(p, work).split(os.sep)[0] for p in written if p.startswith(str(work))}
    assert {"plan.json", "run", "ckpt", "student", "teacher"} <= kinds, kinds  # metrics, checkpoints, card, plan
    assert any(p.endswith("README.md") for p in written) and uploaded is not None and hub_files
    needle = TOKEN.encode()
    leaks = [p for p in written if not os.path.islink(p) and needle in open(p, "rb").read()]
    assert not leaks, f"the token was written to {leaks}"
    assert not any(needle in content for content in hub_files)
