"""lm-evaluation-harness tasks for the recipe's --eval-tasks and `nnx-surgery eval --tasks`: names checked
before any model loads, every model scored through our backend (`nnx_surgery.evaluation.lm_eval_backend`), the scores with
lm-eval's standard errors.

    tasks = checked_tasks("nnx_offline,arc_easy", include_path=None)  # refusals first
    scores = score_folder(folder, tasks)     # {task: {metric: {"value", "stderr"}}}
    scores = score_model(student, tokenizer_folder, tasks)   # an in-memory model, mid-run

Task names are lm-eval's: its registry (downloaded datasets, or the Hub when online), files in `--include-path`
(lm-eval's own task YAML format), and `nnx_offline`, the three offline tasks this package writes from the
standard library (nnx_surgery.evaluation.lm_eval_tasks). Indexing lm-eval's own tasks takes tens of seconds, so it happens
only when a name is not among the local ones. A task whose dataset cannot be read (offline, not downloaded) is
refused before any model loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import io
import logging
import os
import platform
from typing import Any

from nnx_surgery.refusals import RecipeError
from nnx_surgery.evaluation.lm_eval_tasks import write_tasks
from nnx_surgery.surgery.storage.atomic import atomic_folder

TASKS_VERSION = 2  # of the offline tasks' files (nnx_surgery.evaluation.lm_eval_tasks): a change writes them anew
COMPLETE = ".complete"
EXTRA = "pip install 'nnx-surgery[lm-eval]'"


@dataclasses.dataclass(frozen=True)
class Tasks:
    """Checked task names (each known, its dataset read once) and lm-eval's TaskManager that finds them."""

    names: tuple[str, ...]
    manager: Any


def require_lm_eval(flag: str = "--eval-tasks") -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise RecipeError(f"{flag} needs lm-evaluation-harness, which is not installed: {EXTRA}")


def task_names(text: str, flag: str = "--eval-tasks") -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise RecipeError(f"{flag} {text!r}: give task names separated by commas, e.g. nnx_offline,arc_easy.")
    return names


def offline_tasks_folder() -> str:
    """The offline tasks' folder, written once per Python version under $NNX_SURGERY_CACHE (default
    ~/.cache/nnx-surgery), atomically: lm-eval's index and the datasets cache then stay valid across runs."""

    root = os.environ.get("NNX_SURGERY_CACHE", os.path.expanduser("~/.cache/nnx-surgery"))
    folder = os.path.join(root, "lm_eval_tasks", f"python-{platform.python_version()}-v{TASKS_VERSION}")
    if not os.path.isfile(os.path.join(folder, COMPLETE)):
        with atomic_folder(folder, overwrite=True) as staging:
            write_tasks(staging, final=folder)
            open(os.path.join(staging, COMPLETE), "w").close()
    return folder


def checked_tasks(text: str, *, include_path: str | None, flag: str = "--eval-tasks") -> Tasks:
    """The tasks of `text`, each known and its dataset readable, or a RecipeError naming the first that is not
    (with lm-eval's nearest names)."""
    require_lm_eval(flag)
    names = task_names(text, flag)
    if include_path is not None and not os.path.isdir(include_path):
        raise RecipeError(f"--include-path {include_path}: no such folder; give a folder of lm-eval task YAML files.")
    paths = [offline_tasks_folder()] + ([os.path.abspath(include_path)] if include_path else [])
    manager = _manager(tuple(paths), defaults=False)
    if any(name not in manager.all_tasks for name in names):
        manager = _manager(tuple(paths), defaults=True)  # lm-eval's own registry: indexed only when needed
    for name in names:
        if name not in manager.all_tasks:
            near = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f"nearest: {', '.join(near)}" if near else "no task has a similar name"
            raise RecipeError(f"{flag}: unknown task {name!r} ({hint}); lm-eval's tasks, nnx_offline (this "
                              f"package's offline tasks) or a task YAML in --include-path.")
    _check_readable(names, manager, flag)
    return Tasks(names, manager)


@functools.lru_cache(maxsize=4)
def _manager(paths: tuple[str, ...], *, defaults: bool):
    """lm-eval's TaskManager over `paths` (and its own registry with `defaults`), indexed once per process."""
    from lm_eval.tasks import TaskManager
    with _quiet():
        return TaskManager(include_path=paths, include_defaults=defaults)


def _check_readable(names: tuple[str, ...], manager, flag: str) -> None:
    """The tasks loaded once (their datasets read, then in the datasets cache), or one line saying which cannot be."""
    try:
        with _quiet():
            manager.load(list(names))
    except Exception as error:  # datasets' offline and missing-file errors have no common base class
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        offline = " (offline: HF_DATASETS_OFFLINE is set)" if os.environ.get("HF_DATASETS_OFFLINE") else ""
        raise RecipeError(f"{flag} {','.join(names)}: a task's dataset cannot be read{offline}: {first[:300]}; "
                          "download it first (online) or use offline tasks, e.g. nnx_offline.") from None


@contextlib.contextmanager
def _quiet():
    """lm-eval logs at INFO/WARNING through its own loggers and prints progress; the command prints its table."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def score_folder(folder: str, tasks: Tasks, *, batch_size: int = 16, limit: int | None = None,
                 dtype: str = "float32") -> dict:
    """{task: {metric: {"value", "stderr"}}} of the model in `folder` on `tasks` (our lm-eval backend)."""
    from nnx_surgery.evaluation.lm_eval_backend import NNXSurgeryLM
    return score_lm(NNXSurgeryLM(pretrained=folder, dtype=dtype, batch_size=batch_size), tasks, limit=limit)


def score_model(model: Any, tokenizer: str, tasks: Tasks, *, batch_size: int = 16, limit: int | None = None,
                mesh: Any = None) -> dict:
    """The same for an in-memory model (e.g. a student mid-run) and the folder of its tokenizer."""
    from nnx_surgery.evaluation.lm_eval_backend import NNXSurgeryLM
    return score_lm(NNXSurgeryLM(model=model, tokenizer=tokenizer, batch_size=batch_size, mesh=mesh), tasks,
                    limit=limit)


def score_lm(lm: Any, tasks: Tasks, *, limit: int | None = None, bootstrap_iters: int = 1000) -> dict:
    import lm_eval
    with _quiet():
        output = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=tasks.manager, limit=limit,
                                         log_samples=False, verbosity="ERROR", bootstrap_iters=bootstrap_iters)
    return metrics_of(output["results"])


def metrics_of(results: dict) -> dict:
    """lm-eval's `results` ({task: {"acc,none": v, "acc_stderr,none": s, "alias": ...}}) as
    {task: {metric: {"value": v, "stderr": s or None}}} (the filter name kept when it is not "none")."""
    scores = {}
    for task, values in results.items():
        metrics = {}
        for key, value in values.items():
            metric, _, filtered = key.partition(",")
            if not filtered or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = values.get(f"{metric}_stderr,{filtered}")
            name = metric if filtered == "none" else f"{metric} ({filtered})"
            metrics[name] = {"value": float(value),
                             "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
        scores[task] = metrics
    return scores


def task_scores_text(entry: dict) -> str:
    """results["lm_eval"] ({"tasks", "limit", "scores"}, and "seconds" per model where the run timed them) as a
    sentence and a Markdown table."""
    limit = f", at most {entry['limit']} documents each" if entry.get("limit") else ""
    took = f" in {sum(entry['seconds'].values()):.0f} s" if entry.get("seconds") else ""
    return (f"lm-evaluation-harness tasks {', '.join(entry['tasks'])}{limit}, scored through nnx-surgery's lm-eval "
            f"backend{took} (value ± standard error):\n\n" + scores_table(entry["scores"]))


def scores_table(scores: dict[str, dict]) -> str:
    """Markdown: one row per model, one column per task and metric, "value ± stderr"."""
    columns = sorted({(task, metric) for per_model in scores.values() for task, metrics in per_model.items()
                      for metric in metrics})
    lines = ["| model | " + " | ".join(f"{task} {metric}" for task, metric in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for model, per_model in scores.items():
        cells = []
        for task, metric in columns:
            entry = per_model.get(task, {}).get(metric)
            cells.append("-" if entry is None else f"{entry['value']:.4g}" + (
                f" ± {entry['stderr']:.2g}" if entry["stderr"] is not None else ""))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["Tasks", "require_lm_eval", "task_names", "checked_tasks", "score_folder", "score_model", "score_lm",
           "metrics_of", "scores_table", "task_scores_text", "offline_tasks_folder"]
