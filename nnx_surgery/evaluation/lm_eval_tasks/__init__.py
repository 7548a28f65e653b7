"""Offline lm-eval tasks made from text every Python installation has: the standard library's source and the
interpreter's own documentation (`pydoc_data.topics`, the language reference as `help()` shows it).

    python -m nnx_surgery.evaluation.lm_eval_tasks tasks/          # writes the task YAML files and their JSONL data
    HF_DATASETS_OFFLINE=1 lm_eval ... --include_path tasks/ --tasks nnx_offline

Three tasks, in lm-eval's own task YAML format (`dataset_path: json`, the data files beside them), tagged
`nnx_offline`:

    nnx_stdlib_next_line   multiple_choice         the next line of a stdlib function among 4 (3 from other files)
    nnx_pydoc_perplexity   loglikelihood_rolling   pydoc topics: word / byte perplexity and bits per byte
    nnx_stdlib_complete    generate_until          finish a stdlib line from its indentation; stops at "\n"

The data are deterministic for a Python version (a fixed seed over sorted inputs); they change with the version,
as its source and documentation do. The YAML files name the data files by absolute path, so a written folder is
tied to where it was written (write it again elsewhere). lm-eval is not imported here.
"""
from __future__ import annotations

import json
import os
import random
import sysconfig
from nnx_surgery.distill.inputs.sources import general_prose

# None of them in the standard-library corpus `make demo` trains on (4 MB drawn with seed 0, Python 3.11), so the
# demo's students are judged on code they never saw (another corpus may hold some: the recipe's README says so)
SOURCE_FILES = ("textwrap.py", "string.py", "bisect.py", "colorsys.py", "pprint.py", "reprlib.py", "glob.py",
                "posixpath.py", "base64.py", "heapq.py", "calendar.py", "difflib.py", "fractions.py", "numbers.py",
                "sched.py", "statistics.py", "tabnanny.py", "tokenize.py", "weakref.py")
TAG = "nnx_offline"
SEED = 41
CONTEXT_LINES = 6
TOPIC_CHARS = 4000  # each topic cut at a paragraph boundary below this, so the task stays affordable on a CPU


def stdlib_lines(name: str) -> list[str]:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return f.read().splitlines()


def _candidates() -> list[tuple[str, int, list[str]]]:
    """(file, index, lines) of code lines worth predicting: 12-80 characters, not comments or docstrings, with
    CONTEXT_LINES lines before them."""
    found = []
    for name in SOURCE_FILES:
        lines = stdlib_lines(name)
        for i in range(CONTEXT_LINES, len(lines)):
            text = lines[i].strip()
            if 12 <= len(text) <= 80 and not text.startswith(("#", '"', "'")) and lines[i - 1].strip():
                found.append((name, i, lines))
    return found


def next_line_docs(count: int = 200) -> list[dict]:
    """Multiple choice: CONTEXT_LINES lines of code, then the true next line or one of three lines from other files."""
    rng = random.Random(SEED)
    candidates = _candidates()
    docs = []
    for name, i, lines in rng.sample(candidates, count):
        gold = lines[i].strip()
        others = [c for c in candidates if c[0] != name]
        distractors = []
        while len(distractors) < 3:
            other = rng.choice(others)
            text = other[2][other[1]].strip()
            if text != gold and text not in distractors:
                distractors.append(text)
        choices = distractors + [gold]
        rng.shuffle(choices)
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n" + indent
        docs.append({"context": context, "choices": choices, "label": choices.index(gold), "source": f"{name}:{i + 1}"})
    return docs


def completion_docs(count: int = 100) -> list[dict]:
    """Generation: CONTEXT_LINES lines of code and the next line's indentation; the target is the rest of it."""
    rng = random.Random(SEED + 1)
    docs = []
    for name, i, lines in rng.sample(_candidates(), count):
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        docs.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n" + indent, "target": lines[i].strip(),
                     "source": f"{name}:{i + 1}"})
    return docs


def topic_docs() -> list[dict]:
    """The pydoc topics in name order, each cut at the last paragraph boundary before TOPIC_CHARS characters;
    those the recipe's general-prose training mix reads (`general_prose("train")`) left out, so that no recipe
    student was trained on a text it is scored on."""
    from pydoc_data.topics import topics


    trained = set(general_prose("train"))
    docs = []
    for name in sorted(topics):
        if topics[name] in trained:
            continue
        text = topics[name].strip()
        if len(text) > TOPIC_CHARS:
            cut = text.rfind("\n\n", 0, TOPIC_CHARS)
            text = text[:cut if cut > 0 else TOPIC_CHARS].rstrip()
        docs.append({"topic": name, "text": text})
    return docs


def _task(name: str, data_file: str, **fields) -> dict:
    return {"task": name, "tag": [TAG], "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": data_file}}, "test_split": "test", **fields,
            "metadata": {"version": 2.0}}


def task_configs(folder: str) -> dict[str, dict]:
    """The three task configs, reading data files in `folder`."""
    path = os.path.abspath(folder)
    return {
        "nnx_stdlib_next_line": _task(
            "nnx_stdlib_next_line", os.path.join(path, "next_line.jsonl"), output_type="multiple_choice",
            doc_to_text="context", doc_to_choice="choices", doc_to_target="label", target_delimiter="",
            metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                         {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]),
        "nnx_pydoc_perplexity": _task(
            "nnx_pydoc_perplexity", os.path.join(path, "pydoc_topics.jsonl"), output_type="loglikelihood_rolling",
            doc_to_text="", doc_to_target="text",
            metric_list=[{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}]),
        "nnx_stdlib_complete": _task(
            "nnx_stdlib_complete", os.path.join(path, "complete.jsonl"), output_type="generate_until",
            doc_to_text="context", doc_to_target="target", target_delimiter="",
            generation_kwargs={"until": ["\n"], "max_gen_toks": 24, "do_sample": False, "temperature": 0.0},
            metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]),
    }


def write_tasks(folder: str | os.PathLike, *, final: str | os.PathLike | None = None) -> str:
    """Write the three tasks' YAML files and JSONL data into `folder` (created); returns its absolute path, the
    folder to give lm-eval as `--include_path` (or `TaskManager(include_path=...)`). `final`: where the folder
    will be once moved (the YAML files name their data there), when `folder` is a temporary one."""
    folder = os.path.abspath(os.fspath(folder))
    os.makedirs(folder, exist_ok=True)
    for file, docs in (("next_line.jsonl", next_line_docs()), ("complete.jsonl", completion_docs()),
                       ("pydoc_topics.jsonl", topic_docs())):
        with open(os.path.join(folder, file), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in docs)
    for name, config in task_configs(os.path.abspath(os.fspath(final or folder))).items():
        with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as f:
            # JSON is YAML: every value is written quoted and escaped as JSON writes it (the "\n" stop included).
            f.writelines(f"{key}: {json.dumps(value, ensure_ascii=False)}\n" for key, value in config.items())
    return folder


TASKS = ("nnx_stdlib_next_line", "nnx_pydoc_perplexity", "nnx_stdlib_complete")
