"""Publishing to the Hub, against tests/fake_hub.py with the real huggingface_hub client and transformers.

huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_OFFLINE and HF_HUB_DISABLE_XET when it is imported,
so each scenario runs in a subprocess (this file run as a script) with its environment set first. The fake Hub
lives in the pytest process and records every request. Every subprocess logs at DEBUG level, and its whole
output is checked for the token string.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from fake_hub import FakeHub

TOKEN = "hf_fakeTokenForTests7f3a9c2e41b8d6"  # alice, member of org acme
OTHER_TOKEN = "hf_fakeTokenOfBob55e2d1c0a9f8b7"  # bob: read-only member of acme
READ_TOKEN = "hf_fakeReadOnlyTokenOfAlice0c4e9"  # alice, but a read-only token
REPO = "alice/tiny-student"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------ harness
@pytest.fixture(scope="module")
def hub():
    with FakeHub({TOKEN: ("alice", ["acme"]), OTHER_TOKEN: ("bob", ["acme:read"]),
                  READ_TOKEN: ("alice", ["acme"], "read")}, lifetime_s=300) as server:
        yield server


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hub")


def run_scenario(name: str, workdir, env: dict[str, str]) -> dict:
    """Run `python tests/export/test_hub.py name workdir` with `env` added; return its RESULT json."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE"))}
    base.update(JAX_PLATFORMS="cpu", HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), name, str(workdir)], env={**base, **env},
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = proc.stdout + proc.stderr
    for secret in (TOKEN, OTHER_TOKEN, READ_TOKEN):
        assert secret not in output, f"scenario {name} printed a token"
    assert proc.returncode == 0, f"scenario {name} failed:\n{output[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"scenario {name} gave no result:\n{output[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def online_env(hub, workdir) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(workdir / "hf_home"),
            "TEST_OTHER_TOKEN": OTHER_TOKEN, "TEST_READ_TOKEN": READ_TOKEN}


@pytest.fixture(scope="module")
def published(hub, workdir):
    result = run_scenario("publish", workdir, online_env(hub, workdir))
    assert not hub.unhandled, f"the client used endpoints the fake hub lacks: {hub.unhandled}"
    return result


# ------------------------------------------------------------------------------------------------ tests
def test_push_private_then_transformers_downloads_same_logits(published, hub):
    assert published["commit_oid"] in published["commit_url"]
    assert hub.repos[REPO].private
    assert published["nnx_vs_hub_transformers"] <= 1e-4
    assert published["local_vs_hub_transformers"] == 0.0
    assert set(published["hub_files"]) >= {"config.json", "model.safetensors", "README.md", "tokenizer_config.json"}
    # An anonymous client does not see the private repo.
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{hub.url}/api/models/{REPO}", timeout=10)
    assert err.value.code == 401 and err.value.headers["X-Error-Code"] == "RepoNotFound"
    assert published["tokenizer_round_trip"] == "def f(x):\n"
    # The safetensors went through git-LFS, the config as a regular file.
    tree = hub.repos[REPO].commits[hub.repos[REPO].branches["main"]]
    assert tree["model.safetensors"].sha256 and tree["config.json"].sha256 is None


def test_model_card_metadata_round_trips(published):
    card = published["card"]
    assert card["base_model"] == "google/gemma-3-1b-pt"
    assert card["library_name"] == "transformers" and card["pipeline_tag"] == "text-generation"
    assert {"pruned", "distilled", "nnx-surgery"} <= set(card["tags"]) and card["license"] == "gemma"
    assert "12,345 tokens" in card["text"] and "| kl | 0.5 |" in card["text"]
    assert published["bad_license_error"] and "license" in published["bad_license_error"]


def test_branch_revision_holds_the_second_version(published, hub):
    assert hub.repos[REPO].branches.keys() >= {"main", "step-1"}
    shards = [f for f in published["branch_files"] if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in published["branch_files"]
    # The branch started from main's files; main's single model.safetensors would shadow the new index in
    # transformers, so the push deleted it.
    assert "model.safetensors" not in published["branch_files"]
    assert published["branch_vs_perturbed"] <= 1e-4
    assert published["branch_differs_from_main"] > 1e-3  # the branch really holds other weights
    assert published["main_after_branch_push"] <= 1e-4  # and main was not touched


def test_load_pretrained_through_hub(published):
    assert published["load_pretrained_hub"] <= 1e-6
    assert published["load_pretrained_hub_revision"] <= 1e-6


def test_push_errors_online(published, hub):
    errors = published["errors"]
    assert "HubError" in errors["other_namespace"] and "bob" in errors["other_namespace"]
    assert "403" in errors["foreign_repo_server"] and "no write access" in errors["foreign_repo_server"]
    assert "401" in errors["bad_token"] and "rejected" in errors["bad_token"]
    assert "read-only" in errors["read_only_token"]
    assert "no .safetensors" in errors["incomplete_folder"]
    assert "is public" in errors["existing_public_repo"] and not hub.repos["alice/public-student"].private
    assert "bob/tiny-student" not in hub.repos  # refused before anything was created
    assert published["org_push_ok"] and "acme/tiny-student" in hub.repos


def test_offline_load_from_cache_and_push_refused(published, hub, workdir):
    before = len(hub.requests)
    result = run_scenario("offline", workdir, {**online_env(hub, workdir), "HF_HUB_OFFLINE": "1"})
    assert len(hub.requests) == before, hub.requests[before:]  # zero HTTP requests while offline
    assert result["load_pretrained_offline"] <= 1e-6
    assert "offline" in result["push_error"] and "HubError" in result["push_error"]


def test_no_token_and_unreachable_hub(published, hub, workdir):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(workdir / "empty_home"), "TEST_PUSH_TOKEN": TOKEN,
           "TEST_DEAD_ENDPOINT": f"http://127.0.0.1:{dead_port}"}
    before = len(hub.requests)
    result = run_scenario("no_token", workdir, env)
    assert "no Hugging Face token" in result["no_token"]
    assert "cannot reach" in result["unreachable"]
    # The tokenless push never called the Hub (the client's own agent-registry fetch aside).
    assert [r for r in hub.requests[before:] if r[1] != "/api/agent-harnesses"] == []


def test_hub_failures_give_clear_errors_and_transient_ones_are_retried(published, hub, workdir):
    from fake_hub import Blob, Repo

    source = hub.repos[REPO]  # a copy of the student whose listing also names a file outside the snapshot
    tree = dict(source.commits[source.branches["main"]], **{"../escape.json": Blob(2, content=b"{}")})
    escape = hub.repos["alice/escape-student"] = Repo("alice/escape-student", private=True)
    escape.branches["main"] = hub.new_commit(escape, None, tree, "hand-made")
    result = run_scenario("faults", workdir, online_env(hub, workdir))
    assert "CheckpointError" in result["escape"] and "'../escape.json'" in result["escape"]
    assert not any(name.endswith("escape.json") for _, _, names in os.walk(workdir / "hf_home") for name in names)
    hub.clear_faults()
    assert result["retried_push_ok"]  # a 503, a 502 and a dropped LFS upload, each once: retried, pushed
    assert result["retried"] == {"whoami": 2, "preupload": 2, "lfs_put": 2}
    errors = result["errors"]
    assert "HubError" in errors["server_5xx"] and "503" in errors["server_5xx"] and "retries" in errors["server_5xx"]
    assert "404" in errors["not_found"] and "repo id" in errors["not_found"]
    assert "401" in errors["unauthorised"] and "rejected the token" in errors["unauthorised"]
    assert "403" in errors["forbidden"] and "no write access" in errors["forbidden"]
    assert "dropped the connection" in errors["dropped"]
    assert result["whoami_attempts_5xx"] == 6  # the first try and 5 retries
    # An interrupted push (the commit failed after the LFS uploads) completes on a re-run without re-uploading.
    assert "HubError" in errors["interrupted"] and "HTTP 400" in errors["interrupted"]
    assert result["lfs_uploads_first"] >= 1 and result["lfs_uploads_rerun"] == 0
    assert "model.safetensors" in result["resumed_files"] and result["resumed_ok"]
    tree = hub.repos["alice/resumed-student"].commits[hub.repos["alice/resumed-student"].branches["main"]]
    assert hub.file_content(tree["model.safetensors"]) == (workdir / "resumed" / "model.safetensors").read_bytes()


def test_index_naming_a_file_outside_is_not_published(tmp_path):
    from nnx_surgery.export.hub import HubError, check_model_folder

    (tmp_path / "config.json").write_text('{"model_type": "gemma"}')
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "../../etc/passwd"}}))
    with pytest.raises(HubError, match=r"\.\./\.\./etc/passwd"):
        check_model_folder(tmp_path)


# ------------------------------------------------------------------------------------------------ scenarios
def _setup_logging():
    import logging

    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_debug()


def _nnx_logits(model, ids):
    import numpy as np

    return np.asarray(model(ids).logits, dtype=np.float32)


def _error(fn) -> str:
    from nnx_surgery.export.hub import HubError

    try:
        fn()
    except HubError as err:
        return f"HubError: {err}"
    raise AssertionError("expected a HubError")


def scenario_publish(workdir: str) -> dict:
    import shutil

    import numpy as np
    import torch
    import transformers
    from huggingface_hub import ModelCard, hf_hub_download, list_repo_files

    from nnx_surgery import surgery
    from hf_reference import hf_logits, make_hf_model, sample_ids, save_hf
    from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
    from nnx_surgery.export.model_card import write_model_card
    from nnx_surgery.export.hub import push_to_hub

    _setup_logging()
    ids = sample_ids(2, 11)
    teacher = save_hf(make_hf_model("gemma3_text", seed=3), os.path.join(workdir, "teacher"))
    save_byte_tokenizer(teacher)  # copied into the student by save_pretrained(source=teacher)
    model = surgery.load_pretrained(teacher)
    student = surgery.save_pretrained(model, os.path.join(workdir, "student"), source=teacher)
    card_args = dict(teacher_id="google/gemma-3-1b-pt", teacher_revision="abc123",
                     plan_summary={"layers": "4 -> 4", "hidden": "32 -> 32"}, data_description="stdlib source",
                     steps=7, tokens=12345, losses={"kl": 0.5, "ce": [3.0, 2.5, 2.0]},
                     evaluation={"perplexity": {"teacher": 10.0, "student": 12.5}}, license="gemma", repo_id=REPO)
    write_model_card(student, **card_args)
    expected = _nnx_logits(model, ids)
    np.save(os.path.join(workdir, "expected_logits.npy"), expected)
    out: dict = {}

    commit = push_to_hub(student, REPO)
    out.update(commit_url=str(commit), commit_oid=commit.oid, hub_files=set(list_repo_files(REPO)))
    hub_model = transformers.AutoModelForCausalLM.from_pretrained(REPO, dtype=torch.float32).eval()
    out["nnx_vs_hub_transformers"] = float(np.abs(hf_logits(hub_model, ids) - expected).max())
    out["local_vs_hub_transformers"] = float(np.abs(hf_logits(hub_model, ids) - hf_logits(student, ids)).max())
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO)
    out["tokenizer_round_trip"] = tokenizer.decode(tokenizer("def f(x):\n")["input_ids"], skip_special_tokens=True)
    card = ModelCard.load(hf_hub_download(REPO, "README.md"))
    out["card"] = {**{k: getattr(card.data, k) for k in ("base_model", "library_name", "pipeline_tag", "tags",
                                                         "license")}, "text": card.text}

    bad_card = shutil.copytree(student, os.path.join(workdir, "bad_card"))
    write_model_card(bad_card, **{**card_args, "license": "no-such-license"})
    out["bad_license_error"] = _error(lambda: push_to_hub(bad_card, REPO))

    # A second version on a branch: one norm shifted, so its logits differ from main.
    model.norm.scale.set_value(model.norm.scale[...] + 0.25)
    perturbed = _nnx_logits(model, ids)
    np.save(os.path.join(workdir, "branch_logits.npy"), perturbed)
    second = surgery.save_pretrained(model, os.path.join(workdir, "student_step1"), source=teacher,
                                     max_shard_size="60KB")  # several LFS files, uploaded in parallel
    push_to_hub(second, REPO, revision="step-1", commit_message="step 1")
    branch = transformers.AutoModelForCausalLM.from_pretrained(REPO, revision="step-1", dtype=torch.float32)
    out["branch_files"] = list_repo_files(REPO, revision="step-1")
    out["branch_vs_perturbed"] = float(np.abs(hf_logits(branch.eval(), ids) - perturbed).max())
    out["branch_differs_from_main"] = float(np.abs(perturbed - expected).max())
    main = transformers.AutoModelForCausalLM.from_pretrained(REPO, dtype=torch.float32).eval()
    out["main_after_branch_push"] = float(np.abs(hf_logits(main, ids) - expected).max())

    out["load_pretrained_hub"] = float(np.abs(_nnx_logits(surgery.load_pretrained(REPO), ids) - expected).max())
    from_branch = surgery.load_pretrained(REPO, revision="step-1")
    out["load_pretrained_hub_revision"] = float(np.abs(_nnx_logits(from_branch, ids) - perturbed).max())

    incomplete = shutil.copytree(student, os.path.join(workdir, "incomplete"))
    os.remove(os.path.join(incomplete, "model.safetensors"))
    other = os.environ["TEST_OTHER_TOKEN"]
    out["org_push_ok"] = bool(push_to_hub(student, "acme/tiny-student").oid)
    push_to_hub(student, "alice/public-student", private=False)
    out["errors"] = {
        "other_namespace": _error(lambda: push_to_hub(student, "bob/tiny-student")),
        # bob may read acme but not write: our whoami check passes, the server answers 403.
        "foreign_repo_server": _error(lambda: push_to_hub(second, "acme/tiny-student", token=other)),
        "read_only_token": _error(lambda: push_to_hub(student, REPO, token=os.environ["TEST_READ_TOKEN"])),
        "bad_token": _error(lambda: push_to_hub(student, REPO, token="hf_notAValidToken000")),
        "incomplete_folder": _error(lambda: push_to_hub(incomplete, REPO)),
        "existing_public_repo": _error(lambda: push_to_hub(student, "alice/public-student")),  # private=True
    }
    print("RESULT " + json.dumps(out, default=sorted))
    return out


def scenario_offline(workdir: str) -> None:
    import numpy as np

    from nnx_surgery import surgery
    from hf_reference import sample_ids
    from nnx_surgery.export.hub import push_to_hub

    _setup_logging()
    ids = sample_ids(2, 11)
    expected = np.load(os.path.join(workdir, "expected_logits.npy"))
    model = surgery.load_pretrained(REPO)
    out = {"load_pretrained_offline": float(np.abs(_nnx_logits(model, ids) - expected).max()),
           "push_error": _error(lambda: push_to_hub(os.path.join(workdir, "student"), REPO))}
    print("RESULT " + json.dumps(out))


def scenario_no_token(workdir: str) -> None:
    import nnx_surgery.export.hub as hub_module
    from nnx_surgery.export.hub import push_to_hub

    _setup_logging()
    hub_module.RETRY_WAIT_S = 0.01  # the unreachable endpoint is retried like a dropped connection
    student = os.path.join(workdir, "student")
    out = {"no_token": _error(lambda: push_to_hub(student, REPO)),
           "unreachable": _error(lambda: push_to_hub(student, REPO, token=os.environ["TEST_PUSH_TOKEN"],
                                                     endpoint=os.environ["TEST_DEAD_ENDPOINT"]))}
    print("RESULT " + json.dumps(out))


def _control(action: str, **payload) -> dict:
    request = urllib.request.Request(f"{os.environ['HF_ENDPOINT']}/__control/{action}", method="POST",
                                     data=json.dumps(payload).encode())
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read() or b"{}")


def _count(method: str, path: str) -> int:
    return _control("count", method=method, path=path)["count"]


def _fresh_copy(student: str, name: str, shift: float) -> str:
    """The student with one norm shifted: weights the Hub has not seen, so their LFS upload really happens."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = shutil.copytree(student, os.path.join(os.path.dirname(student), name))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + shift
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def scenario_faults(workdir: str) -> None:
    from huggingface_hub import list_repo_files

    import nnx_surgery.export.hub as hub_module
    from nnx_surgery.export.hub import push_to_hub

    _setup_logging()
    hub_module.RETRY_WAIT_S = 0.01  # our own retries (whoami, create_repo, ...) at test speed
    student = os.path.join(workdir, "student")
    paths = {"whoami": "^/api/whoami-v2$", "preupload": "/preupload/", "lfs_put": "^/__lfs/"}
    before = {name: _count("PUT" if name == "lfs_put" else "POST" if name == "preupload" else "GET", path)
              for name, path in paths.items()}
    _control("fail", method="GET", path=paths["whoami"], answer=503)
    _control("fail", method="POST", path=paths["preupload"], answer=502)
    _control("fail", method="PUT", path=paths["lfs_put"], answer="drop")
    out = {"retried_push_ok": bool(push_to_hub(_fresh_copy(student, "retry", 0.5), "alice/retry-student").oid)}
    out["retried"] = {name: _count("PUT" if name == "lfs_put" else "POST" if name == "preupload" else "GET", path)
                      - before[name] for name, path in paths.items()}

    errors, calls = {}, _count("GET", paths["whoami"])
    _control("fail", method="GET", path=paths["whoami"], answer=503, times=99)
    errors["server_5xx"] = _error(lambda: push_to_hub(student, REPO))
    out["whoami_attempts_5xx"] = _count("GET", paths["whoami"]) - calls
    _control("clear")
    _control("fail", method="POST", path="^/api/repos/create$", answer=404)
    errors["not_found"] = _error(lambda: push_to_hub(student, "alice/missing-student"))
    _control("fail", method="GET", path="^/api/models/alice/tiny-student$", answer=401)
    errors["unauthorised"] = _error(lambda: push_to_hub(student, REPO))
    _control("fail", method="POST", path="/preupload/", answer=403)
    errors["forbidden"] = _error(lambda: push_to_hub(student, REPO))
    _control("fail", method="GET", path=paths["whoami"], answer="drop", times=99)
    errors["dropped"] = _error(lambda: push_to_hub(student, REPO))
    _control("clear")

    lfs, student = _count("PUT", paths["lfs_put"]), _fresh_copy(student, "resumed", 0.25)
    _control("fail", method="POST", path="^/api/models/alice/resumed-student/commit/", answer=400)
    errors["interrupted"] = _error(lambda: push_to_hub(student, "alice/resumed-student"))
    out["lfs_uploads_first"] = _count("PUT", paths["lfs_put"]) - lfs
    lfs = _count("PUT", paths["lfs_put"])
    out["resumed_ok"] = bool(push_to_hub(student, "alice/resumed-student").oid)
    out["lfs_uploads_rerun"] = _count("PUT", paths["lfs_put"]) - lfs
    out["resumed_files"] = list_repo_files("alice/resumed-student")
    out["errors"] = errors
    from nnx_surgery.surgery import CheckpointError, load_pretrained
    try:
        load_pretrained("alice/escape-student")
        out["escape"] = "loaded"
    except CheckpointError as err:
        out["escape"] = f"CheckpointError: {err}"
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    {"publish": scenario_publish, "offline": scenario_offline, "no_token": scenario_no_token,
     "faults": scenario_faults}[sys.argv[1]](sys.argv[2])
