"""The lm-eval backend (nnx_surgery/evaluation/lm_eval_backend.py) against lm-eval's own `hf` backend (transformers) on the
same folders and the same offline tasks (nnx_surgery/evaluation/lm_eval_tasks), in float32: every request's log-likelihood
within 1e-4, the greedy flags, the generations and the task metrics the same. Tiny random Gemma 3 checkpoints with
a real BPE tokenizer (tests/tiny_tokenizers.py), a trimmed-vocabulary student cut from one, lm-eval's command line
through our module (with a 2-device mesh), bad input; the real Gemma 3 270M in a `slow` test."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_reference import make_hf_model, save_hf  # noqa: E402
from recipe_env import with_host_devices  # noqa: E402
from tiny_tokenizers import SAVERS, stdlib_text  # noqa: E402

from nnx_surgery.evaluation.lm_eval_tasks import TAG, TASKS, write_tasks  # noqa: E402

LIMIT = 4  # documents per task: 4 x 4 choices, 4 rolling texts (several windows each), 4 generations
TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    """A tiny random Gemma 3 (sliding and full layers, 128 positions) with a Gemma-style BPE tokenizer."""
    folder = str(tmp_path_factory.mktemp("lm-eval-tiny"))
    size = SAVERS["gemma"](folder)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size), folder)
    return folder


@pytest.fixture(scope="module")
def tasks_folder(tmp_path_factory) -> str:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.fixture(scope="module")
def task_manager(lm_eval, tasks_folder):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=tasks_folder, include_defaults=False)  # indexing lm-eval's own tasks takes 26 s


def _evaluate(lm_eval, model, task_manager, tasks=(TAG,), limit=LIMIT) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=task_manager, limit=limit,
                                   log_samples=True, bootstrap_iters=0)


def _ours(folder: str, **args):
    from nnx_surgery.evaluation.lm_eval_backend import NNXSurgeryLM
    _ours.last = NNXSurgeryLM(pretrained=folder, dtype="float32", batch_size=4, **args)
    return _ours.last


def _hf(folder: str, **args):
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=folder, dtype="float32", device="cpu", batch_size=4, **args)


def assert_same_results(ours: dict, theirs: dict, tolerance: float = TOLERANCE, relative: float = 0.0) -> int:
    """Per request: log-likelihoods within `tolerance` + `relative` of themselves (a rolling text's total, a float32
    sum over many tokens: at least 2e-7 of itself more), greedy flags and generations equal; per task: accuracy and
    exact match equal, perplexities to float32 rounding of the sums. Returns the number of requests compared."""
    compared = 0
    assert sorted(ours["samples"]) == sorted(theirs["samples"])
    for task, samples in ours["samples"].items():
        other = {s["doc_id"]: s for s in theirs["samples"][task]}
        assert len(samples) == len(other)
        for sample in samples:
            for mine, reference in zip(sample["resps"], other[sample["doc_id"]]["resps"], strict=True):
                mine, reference = mine[0], reference[0]
                if isinstance(mine, str):
                    assert mine == reference, (task, sample["doc_id"])
                elif isinstance(mine, tuple):
                    bound = tolerance + relative * abs(reference[0])
                    assert abs(mine[0] - reference[0]) <= bound, (task, sample["doc_id"], mine, reference)
                    assert mine[1] == reference[1], (task, sample["doc_id"], mine, reference)
                else:  # a rolling text's total: a float32 sum over hundreds of tokens, rounded at ~1e-7 of itself
                    bound = tolerance + max(2e-7, relative) * abs(reference)
                    assert abs(mine - reference) <= bound, (task, sample["doc_id"], mine, reference)
                compared += 1
    for task, metrics in ours["results"].items():
        for key, value in metrics.items():
            if key in ("name", "alias") or "stderr" in key:
                continue
            if "perplexity" in key or "bits_per_byte" in key:
                np.testing.assert_allclose(value, theirs["results"][task][key], rtol=max(1e-5, 10 * relative),
                                           err_msg=key)  # exp of (total / words): 10 x the totals' bound
            else:
                assert value == theirs["results"][task][key], (task, key)
    return compared


def test_offline_tasks_match_the_hf_backend(lm_eval, tiny_folder, task_manager):
    ours = _evaluate(lm_eval, _ours(tiny_folder), task_manager)
    theirs = _evaluate(lm_eval, _hf(tiny_folder), task_manager)
    assert sorted(ours["results"]) == sorted(TASKS)
    counts = {task: len(samples) for task, samples in ours["samples"].items()}
    assert counts == {task: LIMIT for task in TASKS}
    assert assert_same_results(ours, theirs) == LIMIT * (4 + 1 + 1)
    # the texts are long enough for several rolling windows of the model's 128 positions, and generation stops
    lm = _ours.last  # each rolling text spans more than two windows of the model's 128 positions
    texts = [s["doc"]["text"] for s in ours["samples"]["nnx_pydoc_perplexity"]]
    assert all(len(lm.tok_encode(text)) > 2 * lm.max_length for text in texts)
    generated = [s["resps"][0][0] for s in ours["samples"]["nnx_stdlib_complete"]]
    assert all("\n" not in text for text in generated) and any(generated)


def test_requests_compile_once_per_bucket(lm_eval, tiny_folder):
    """Contexts of many lengths: one compilation per (batch, length bucket), and batches that are not full are
    padded with rows that change nothing."""
    from lm_eval.api.instance import Instance
    from nnx_surgery.evaluation.lm_eval_scoring import length_buckets, score_batch

    lm = _ours(tiny_folder)
    assert length_buckets(lm.max_length) == [16, 24, 32, 48, 64, 96, 128] and lm.max_length == 128
    text = stdlib_text("bisect.py")
    requests = [Instance("loglikelihood", {}, (text[:n], text[n:n + 9]), i) for i, n in enumerate(range(40, 400, 30))]
    before = score_batch._cache_size()
    scored = lm.loglikelihood(requests)
    widths = {min(b for b in lm.buckets if b >= min(len(lm.tok_encode(r.args[0] + r.args[1])) - 1, 128))
              for r in requests}
    compiled = score_batch._cache_size() - before
    assert len(widths) >= 3 and 2 <= compiled <= len(widths)  # batches of 4 rows sorted by length share buckets
    assert lm.loglikelihood(requests[::-1]) == scored[::-1] and score_batch._cache_size() == before + compiled
    alone = [lm.loglikelihood([request])[0] for request in requests[:3]]
    for (a, greedy_a), (b, greedy_b) in zip(scored[:3], alone):
        assert abs(a - b) < 1e-5 and greedy_a == greedy_b


def test_the_head_runs_in_chunks_of_bounded_logits(lm_eval, tiny_folder, monkeypatch):
    """A rolling window scores every position: the head runs over HEAD_ELEMENTS logits at a time (the real 270M
    would need 26 GB for 16 rows of 1,536 positions at once). Chunks of 5 positions (the last one padded) give the
    log-likelihoods and greedy flags of one chunk, for rows scored alone and for choices sharing a context."""
    from lm_eval.api.instance import Instance
    from nnx_surgery.evaluation import lm_eval_scoring

    lm = _ours(tiny_folder)
    text = stdlib_text("bisect.py")
    requests = [Instance("loglikelihood_rolling", {}, (text[:n],), i) for i, n in enumerate((300, 450, 700))]
    pieces = [Instance("loglikelihood", {}, (text[:n], text[n:n + 40]), i) for i, n in enumerate((60, 90, 200))]
    pieces += [Instance("loglikelihood", {}, (text[:150], text[m:m + 30]), 3 + i) for i, m in enumerate((150, 400))]

    def scores():
        for jitted in (lm_eval_scoring.score_batch, lm_eval_scoring.score_shared_contexts):
            jitted.clear_cache()
        return lm.loglikelihood_rolling(requests), lm.loglikelihood(pieces)

    whole = scores()
    monkeypatch.setattr(lm_eval_scoring, "HEAD_ELEMENTS", 5 * lm.model.config.vocab_size)
    chunked = scores()
    monkeypatch.undo()
    assert np.allclose(whole[0], chunked[0], atol=1e-4) and len(chunked[0]) == 3
    assert [flag for _, flag in whole[1]] == [flag for _, flag in chunked[1]]
    assert np.allclose([v for v, _ in whole[1]], [v for v, _ in chunked[1]], atol=1e-5)


def test_choices_of_one_context_share_its_pass(lm_eval, tiny_folder):
    """Requests with the same context (a multiple-choice question) run the context once into a KV cache and each
    continuation from it (through the ring of the sliding-window layers: the tiny model's window is 5 tokens): the
    same log-likelihoods (1e-5) and greedy flags as each request scored alone, one context pass per question; a
    context the model's positions cannot hold with its continuation is scored alone."""
    from lm_eval.api.instance import Instance
    from nnx_surgery.evaluation import lm_eval_scoring

    lm = _ours(tiny_folder)
    text = stdlib_text("bisect.py")
    questions = [(text[s:s + 120], [text[s + 120:s + 120 + n] for n in (1, 9, 30, 4)]) for s in (0, 300, 900)]
    requests = [Instance("loglikelihood", {}, (context, choice), i)
                for i, (context, choice) in enumerate((c, x) for c, choices in questions for x in choices)]
    single_token = [Instance("loglikelihood", {}, (text[:80], choice), i) for i, choice in enumerate(("x", "y"))]
    before = lm_eval_scoring.score_shared_contexts._cache_size()
    assert len(lm._shared_contexts([(None, *lm._encode_pair(*r.args)) for r in requests])) == 3
    together = lm.loglikelihood(requests) + lm.loglikelihood(single_token)
    assert lm_eval_scoring.score_shared_contexts._cache_size() > before
    alone = [lm.loglikelihood([r])[0] for r in requests + single_token]
    assert [flag for _, flag in together] == [flag for _, flag in alone]
    assert np.allclose([v for v, _ in together], [v for v, _ in alone], atol=1e-5)
    long_context = [(None, list(range(3, 3 + lm.max_length)), [5, 6]), (None, list(range(3, 3 + lm.max_length)), [7])]
    assert lm._shared_contexts(long_context) == []
    # a call holds at most batch_size continuations (here 4): a larger group is cut, groups are packed by size
    assert lm._shared_contexts([(None, [3, 4, 5], [6])] * 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lm._shared_calls([[0, 1], [2, 3], [4, 5, 6], [7, 8]]) == [[[0, 1], [2, 3]], [[4, 5, 6]], [[7, 8]]]


@pytest.fixture(scope="module")
def trimmed_student(tiny_folder, tmp_path_factory) -> str:
    """A student of the tiny teacher with 3 of its 4 layers and 450 of its vocabulary's pieces, cut from disk with
    its own trimmed tokenizer.json (as tests/surgery/planning/test_vocab_trim.py makes them)."""
    from tokenizers import Tokenizer
    from nnx_surgery.surgery import StudentSpec, load_pretrained, plan_student, prune_checkpoint

    tokenizer = Tokenizer.from_file(os.path.join(tiny_folder, "tokenizer.json"))
    ids = np.concatenate([tokenizer.encode(stdlib_text(name)).ids for name in ("fnmatch.py", "glob.py")])
    rows = ids[:len(ids) // 32 * 32].reshape(-1, 32).astype(np.int32)
    plan = plan_student(load_pretrained(tiny_folder), StudentSpec(3, 24, 32, 2, 1, vocab_size=450),
                        calibration=rows, num_samples=8, source=tiny_folder)
    return str(prune_checkpoint(tiny_folder, plan, tmp_path_factory.mktemp("lm-eval-student") / "student"))


def test_trimmed_student_matches_the_hf_backend(lm_eval, trimmed_student, task_manager):
    ours_lm = _ours(trimmed_student)
    assert ours_lm.config.vocab_size == 450 and ours_lm.tok.tokenizer.get_vocab_size() == 450
    ours = _evaluate(lm_eval, ours_lm, task_manager, limit=3)
    theirs = _evaluate(lm_eval, _hf(trimmed_student), task_manager, limit=3)
    assert assert_same_results(ours, theirs) == 3 * (4 + 1 + 1)


def test_lm_eval_command_line_through_our_module_on_a_mesh(lm_eval, tiny_folder, tasks_folder, task_manager,
                                                           tmp_path):
    """lm-eval's own command line cannot load a model class from another package; `python -m
    nnx_surgery.evaluation.lm_eval_backend` is lm-eval's command line with ours registered. Run offline on 2 CPU devices
    (mesh=fsdp=2: the batch split over them), it gives the requests of one device."""
    env = {**os.environ, "XLA_FLAGS": with_host_devices(2), "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "nnx_surgery.evaluation.lm_eval_backend", "run", "--model", "nnx-surgery",
               "--model_args", f"pretrained={tiny_folder},dtype=float32,mesh=fsdp=2", "--include_path", tasks_folder,
               "--tasks", "nnx_stdlib_next_line", "--limit", "3", "--batch_size", "4", "--log_samples",
               "--output_path", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nnx_stdlib_next_line" in proc.stdout and "acc" in proc.stdout
    (samples_file,) = list(out.rglob("samples_nnx_stdlib_next_line_*.jsonl"))
    on_mesh = [json.loads(line) for line in samples_file.read_text().splitlines()]
    single = _evaluate(lm_eval, _ours(tiny_folder), task_manager, tasks=["nnx_stdlib_next_line"], limit=3)
    by_doc = {s["doc_id"]: s for s in single["samples"]["nnx_stdlib_next_line"]}
    for sample in on_mesh:
        for mine, reference in zip(sample["resps"], by_doc[sample["doc_id"]]["resps"], strict=True):
            assert abs(float(mine[0][0]) - reference[0][0]) <= TOLERANCE  # sums split over 2 devices round apart
            assert (mine[0][1] in (True, "True")) == reference[0][1]


def test_offline_tasks_are_deterministic(tmp_path):
    first, second = write_tasks(tmp_path / "a"), write_tasks(tmp_path / "b")
    for name in ("next_line.jsonl", "complete.jsonl", "pydoc_topics.jsonl"):
        assert Path(first, name).read_bytes() == Path(second, name).read_bytes()
    docs = [json.loads(line) for line in Path(first, "next_line.jsonl").read_text().splitlines()]
    assert len(docs) == 200 and all(len(d["choices"]) == 4 and len(set(d["choices"])) == 4 for d in docs)
    assert all(d["choices"][d["label"]].strip() for d in docs)
    assert sorted(os.listdir(first)) == sorted([*(f"{t}.yaml" for t in TASKS), "next_line.jsonl",
                                                "complete.jsonl", "pydoc_topics.jsonl"])


def test_offline_tasks_hold_no_text_the_recipes_training_reads(tmp_path):
    """No pydoc topic of the general-prose training mix is scored, and (on the Python the demo's figures were made
    with) none of the code tasks' modules is in the demo's standard-library corpus."""
    import sys

    from nnx_surgery.distill.inputs.sources import general_prose, stdlib_corpus
    from nnx_surgery.evaluation.lm_eval_tasks import SOURCE_FILES, topic_docs

    trained = {text.strip()[:200] for text in general_prose("train")}
    scored = topic_docs()
    assert scored and not any(doc["text"][:200] in trained for doc in scored)
    assert len(scored) + len(general_prose("train")) >= len(set(general_prose("heldout") + general_prose("aside")))
    if sys.version_info[:2] == (3, 11):
        import sysconfig
        root = Path(sysconfig.get_paths()["stdlib"])
        demo = {path.name for path in map(Path, stdlib_corpus(max_bytes=4_000_000, seed=0)) if path.parent == root}
        assert not demo & set(SOURCE_FILES)


def test_make_demo_names_offline_tasks_that_exist():
    """`make demo`'s --eval-tasks (the command `recipes.demo_choice` runs, on a CPU and on an accelerator) are
    tasks of nnx_offline (a misspelt one would stop the demo before training): the code tasks, not the pydoc
    perplexity task, whose topics are the general held-out set's source."""
    from nnx_surgery.recipes import demo_choice

    assert "nnx_surgery.recipes.demo_choice" in (REPO / "Makefile").read_text().split("\ndemo:", 1)[1]
    for platform in ("cpu", "tpu"):
        flags = demo_choice.choose(demo_choice.Backend(platform, "", 1)).command("python")
        names = flags[flags.index("--eval-tasks") + 1].split(",")
        assert set(names) == {"nnx_stdlib_next_line", "nnx_stdlib_complete"} and set(names) < set(TASKS)
        assert flags[flags.index("--eval-tasks-limit") + 1] == "20"


def test_a_folder_that_is_not_a_model_is_one_clear_error(lm_eval, tmp_path, tiny_folder, task_manager):
    from nnx_surgery.evaluation.lm_eval_backend import LMEvalBackendError, NNXSurgeryLM

    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "empty"): "no config.json there, so it is not a model folder",
             str(tmp_path / "missing"): "no such folder"}
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in os.listdir(tiny_folder):
        if not name.startswith("tokenizer"):
            os.symlink(os.path.join(tiny_folder, name), no_tokenizer / name)
    cases[str(no_tokenizer)] = "no tokenizer.json there"
    for folder, message in cases.items():
        with pytest.raises(LMEvalBackendError, match=message) as caught:
            NNXSurgeryLM(pretrained=folder)
        assert "\n" not in str(caught.value) and f"pretrained={folder}" in str(caught.value)
    with pytest.raises(ValueError, match="no config.json"):
        lm_eval.simple_evaluate(model="nnx-surgery", model_args=f"pretrained={tmp_path / 'empty'}",
                                 tasks=["nnx_stdlib_next_line"], task_manager=task_manager)


def test_without_the_extra_the_import_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "nnx_surgery.evaluation.lm_eval_backend", raising=False)
    with pytest.raises(ImportError) as caught:
        import nnx_surgery.evaluation.lm_eval_backend  # noqa: F401
    assert "pip install 'nnx-surgery[lm-eval]'" in str(caught.value) and "\n" not in str(caught.value)


def _lm_eval_imports(path: Path) -> list[ast.AST]:
    """The import statements of `path` that import the lm_eval package (not modules named lm_eval_*)."""
    def of_lm_eval(name: str | None) -> bool:
        return name is not None and (name == "lm_eval" or name.startswith("lm_eval."))
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if (isinstance(node, ast.Import) and any(of_lm_eval(alias.name) for alias in node.names))
            or (isinstance(node, ast.ImportFrom) and node.level == 0 and of_lm_eval(node.module))]


def test_nothing_else_in_the_package_imports_lm_eval():
    """Only the backend and the recipe's scorer (which runs lm-eval's own evaluator) import lm_eval, and the scorer
    only inside its functions: importing the package, its commands or the recipe never needs the extra."""
    package = REPO / "nnx_surgery"
    importers = sorted(str(path.relative_to(REPO)) for path in package.rglob("*.py") if _lm_eval_imports(path))
    assert importers == ["nnx_surgery/evaluation/lm_eval_backend.py", "nnx_surgery/evaluation/lm_eval_scores.py"]
    scorer = ast.parse((package / "evaluation" / "lm_eval_scores.py").read_text())
    top_level = [node for node in scorer.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not any(node in top_level for node in _lm_eval_imports(package / "evaluation" / "lm_eval_scores.py"))
    assert len(_lm_eval_imports(package / "evaluation" / "lm_eval_scores.py")) >= 2


@pytest.mark.slow
def test_real_gemma3_270m_matches_the_hf_backend(lm_eval, task_manager):
    """The real Gemma 3 270M: ours given the packaged GGUF (`gguf:gemma3-270m`, imported once as a float32 folder),
    lm-eval's hf backend on that same folder; a few requests of each kind. The bound is relative here: two float32
    implementations of 18 layers and a 262k-piece softmax round apart by about 1e-5 of a log-likelihood (the
    repository's logits test of this model allows 1e-4 of the largest logit)."""
    from real_gemma import cached_import

    ours_lm = _ours("gguf:gemma3-270m", max_length=256)  # windows of 256 positions: rolling texts span several
    folder = cached_import("float32")
    assert ours_lm.folder == os.path.abspath(folder) and ours_lm.max_length == 256
    ours = _evaluate(lm_eval, ours_lm, task_manager, limit=2)
    theirs = _evaluate(lm_eval, _hf(folder, max_length=256), task_manager, limit=2)
    assert assert_same_results(ours, theirs, tolerance=TOLERANCE, relative=5e-5) == 2 * (4 + 1 + 1)


# ------------------------------------------------------------------------- nnx-surgery eval --eval-tasks refusals
def _eval_with_tasks(tiny_folder, out, *task_flags):
    from refusal_env import run
    return run("eval", "--teacher", tiny_folder, tiny_folder, "--output", str(out), *task_flags)


def test_eval_refuses_unknown_and_unreadable_tasks_before_loading_a_model(lm_eval, tiny_folder, tmp_path):
    from refusal_env import assert_refused
    # a name near one of ours: lm-eval's registry is indexed (once per process) and the nearest names given
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "a", "--eval-tasks", "nnx_offline,nnx_stdlib_nextline")
    assert_refused(code, out, err, "unknown task 'nnx_stdlib_nextline' (nearest: nnx_stdlib_next_line")
    # a task of lm-eval's registry whose dataset is not on this machine (HF_DATASETS_OFFLINE, the fixture)
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "b", "--eval-tasks", "arc_easy")
    assert_refused(code, out, err, "--eval-tasks arc_easy: a task's dataset cannot be read (offline")
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "c", "--eval-tasks", " , ")
    assert_refused(code, out, err, "give task names separated by commas")
    assert not any((tmp_path / name).exists() for name in "abc")  # refused before --output was made


def test_eval_task_flags_without_the_extra_or_without_tasks(tiny_folder, tmp_path, monkeypatch):
    import importlib.util

    from refusal_env import assert_refused
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "a", "--include-path", str(tmp_path))
    assert_refused(code, out, err, "--include-path")
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "b", "--eval-tasks", "nnx_offline", "--include-path",
                                      str(tmp_path / "nowhere"))
    assert_refused(code, out, err, "--include-path")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    code, out, err = _eval_with_tasks(tiny_folder, tmp_path / "c", "--eval-tasks", "nnx_offline")
    assert_refused(code, out, err, "pip install 'nnx-surgery[lm-eval]'")
