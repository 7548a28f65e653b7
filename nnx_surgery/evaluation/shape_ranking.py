"""Which student shape: give each candidate the same short distillation and rank them on held-out text.

    candidates = [SearchCandidate(c.text, build=lambda c=c: prune(c.spec), plan=...) for c in shapes]
    result = search(teacher, candidates, data, config, sets=[in_domain, general], directory="runs/search",
                    eval_at=(100, 200, 400))
    result.winner                      # the best candidate at the last step, on the first set's CE

This is Minitron's recipe for choosing a shape: enumerate the shapes within a parameter budget, prune each from
the teacher, train each briefly on identical batches with identical settings, rank by held-out loss, and train the
winner long. The ranking right after pruning does not predict the ranking after training, which is why every
candidate gets the short distillation; scoring at several points shows whether the ranking has settled.

Each candidate gets a folder in `directory` with its checkpoints and `curve.json` (the scores so far); a finished
candidate (its `result.json`) is not redone, and an interrupted one continues from its last checkpoint, so a search
of hours can be stopped and resumed. `search.json`, `search.md` and `search.png` describe the whole search.
distill never imports surgery: a candidate is a name and a function that builds its student.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import time
from typing import Any, Callable, Mapping, Sequence

from nnx_surgery.distill.inputs.cache_format import atomic_bytes
from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig
from nnx_surgery.evaluation.heldout_sets import HeldoutSet, score_heldout, summarise
from nnx_surgery.distill.loop.trainer import run

METRICS = ("ce", "ce_per_byte", "kl", "top1_agreement")


@dataclasses.dataclass(frozen=True)
class SearchCandidate:
    """A student shape to try: `build()` returns its pruned student (built only when it is trained, so one
    candidate is in memory at a time); `plan` goes to `DistillConfig.plan` (the layer map of feature losses);
    `note` is shown beside the name in search.md and kept in search.json (e.g. "uniform guess")."""

    name: str
    build: Callable[[], Any]
    plan: Any = None
    parameters: int | None = None
    non_embedding: int | None = None
    note: str | None = None


@dataclasses.dataclass
class SearchResult:
    """Every candidate's curve (`rows`, ranked at the last step) and the teacher's scores on each set."""

    rows: list[dict[str, Any]]
    teacher: dict[str, dict[str, float]]
    eval_at: tuple[int, ...]
    rank_by: tuple[str, str]

    @property
    def winner(self) -> str:
        return self.rows[0]["name"]

    def ranking(self, step: int | None = None) -> list[str]:
        """Candidate names, best first, by `rank_by` at `step` (default: the last)."""
        return rank_curves(self.rows, step if step is not None else self.eval_at[-1], *self.rank_by)

    def to_dict(self) -> dict[str, Any]:
        return {"eval_at": list(self.eval_at), "rank_by": list(self.rank_by), "teacher": self.teacher,
                "rankings": {str(s): self.ranking(s) for s in self.eval_at}, "candidates": self.rows}

    def markdown(self) -> str:
        return search_markdown(self)


def search(teacher: Any, candidates: Sequence[SearchCandidate], data: Any, config: DistillConfig, *,
           sets: Sequence[HeldoutSet], directory: str, eval_at: Sequence[int] | None = None,
           rank_by: tuple[str, str] | None = None, log: Callable[[str], None] | None = None,
           sampler: Any = None, teacher_cache: str | None = None) -> SearchResult:
    """Distil every candidate with `config` (its stages' steps are the search length) on the same batches of
    `data` (a callable returning a fresh data object, or one that `copy.deepcopy` can copy, e.g. TokenBatches),
    score each on `sets` at every step of `eval_at` (default: the last), and rank them by `rank_by` = (set name,
    metric) (default: the first set's CE). Results go to `directory` (see the module docstring). `sampler` goes
    to `distill.run` (needed when `config.on_policy.fraction` > 0). `teacher_cache`: a teacher cache of the rows
    the candidates read (`distill.inputs.topk_cache`): every candidate trains from it, the teacher only scores the
    held-out sets."""
    log = log or (lambda line: print(line, flush=True))
    total = config.total_steps
    eval_at = tuple(sorted({int(s) for s in (eval_at or ())} | {total}))
    if eval_at[0] < 1 or eval_at[-1] > total:
        raise ValueError(f"eval_at {list(eval_at)}: every point must be a step in 1..{total} (the config's steps).")
    names = [c.name for c in candidates]
    if not candidates or len({_folder_name(n) for n in names}) != len(names):
        raise ValueError(f"search needs candidates with distinct names (also as folder names); got {names}.")
    if not sets:
        raise ValueError("search needs at least one held-out set to rank by (sets=[HeldoutSet, ...]).")
    rank_by = rank_by or (sets[0].name, "ce")
    if rank_by[0] not in {s.name for s in sets} or rank_by[1] not in METRICS:
        raise ValueError(f"rank_by={rank_by}: give (one of {[s.name for s in sets]}, one of {METRICS}).")
    os.makedirs(directory, exist_ok=True)
    fresh_data = data if callable(data) else (lambda: copy.deepcopy(data))
    teacher_hidden: dict = {}  # the teacher's hidden states on each set, computed once for every candidate
    teacher_scores = {held.name: _summary(summarise(score_heldout(
        {"teacher": teacher}, held, reference="teacher", log=lambda line: None,
        reference_cache=teacher_hidden)["teacher"], held)) for held in sets}
    rows: list[dict[str, Any]] = []
    for number, candidate in enumerate(candidates, start=1):
        log(f"[search] {number}/{len(candidates)} {candidate.name}")
        curve = _candidate_curve(teacher, candidate, fresh_data, config, sets, eval_at,
                                 os.path.join(directory, _folder_name(candidate.name)), log, teacher_hidden, sampler,
                                 teacher_cache)
        rows.append({"name": candidate.name, "parameters": candidate.parameters,
                     "non_embedding": candidate.non_embedding, "curve": curve}
                    | ({"note": candidate.note} if candidate.note else {}))
    order = rank_curves(rows, eval_at[-1], *rank_by)
    rows.sort(key=lambda r: order.index(r["name"]))
    result = SearchResult(rows, teacher_scores, eval_at, (rank_by[0], rank_by[1]))
    _write_atomic(os.path.join(directory, "search.json"), json.dumps(result.to_dict(), indent=1))
    _write_atomic(os.path.join(directory, "search.md"), result.markdown())
    plot_search(result, os.path.join(directory, "search.png"))
    log(f"[search] winner: {result.winner} ({rank_by[0]} {rank_by[1]} "
        f"{_point(rows[0]['curve'], eval_at[-1])[rank_by[0]][rank_by[1]]:.4f} at step {eval_at[-1]})")
    return result


def _candidate_curve(teacher, candidate, fresh_data, config, sets, eval_at, folder, log,
                     teacher_hidden: dict, sampler: Any = None, teacher_cache: str | None = None) -> list[dict]:
    """The candidate's scores at each point of `eval_at`: from its result.json when finished, else trained (from
    its newest checkpoint when there is one) and scored point by point, each point saved as it is reached."""
    done_path, curve_path = os.path.join(folder, "result.json"), os.path.join(folder, "curve.json")
    if os.path.exists(done_path):
        with open(done_path) as f:
            log(f"[search]   finished earlier: {done_path}")
            return json.load(f)["curve"]
    os.makedirs(folder, exist_ok=True)
    curve = []
    if os.path.exists(curve_path):
        with open(curve_path) as f:
            curve = json.load(f)
    student, data = candidate.build(), fresh_data()
    checkpoint_dir = os.path.join(folder, "checkpoints")
    checkpoints = CheckpointConfig(directory=checkpoint_dir, every=config.total_steps, keep=1)
    for stop in eval_at:
        if any(point["step"] == stop for point in curve):
            continue
        started = time.perf_counter()
        result = run(None if teacher_cache else teacher, student, data, dataclasses.replace(
            config, plan=candidate.plan if candidate.plan is not None else config.plan, halt_after=stop,
            checkpoint=checkpoints, run_dir=None, progress=False, plots=False, teacher_cache=teacher_cache),
            sampler=sampler)
        student = result.student
        point = {"step": stop, "train_s": round(time.perf_counter() - started, 1),
                 "tokens": stop * config.grad_accum * (config.batch_size or 0) * (config.seq_len or 0) or None}
        for held in sets:
            scores = score_heldout({"teacher": teacher, "student": student}, held, reference="teacher",
                                   log=lambda line: None, reference_cache=teacher_hidden)
            point[held.name] = _summary(summarise(scores["student"], held))
        curve.append(point)
        _write_atomic(curve_path, json.dumps(curve, indent=1))
        log(f"[search]   step {stop}: " + ", ".join(f"{h.name} CE {point[h.name]['ce']:.4f}" for h in sets)
            + f" ({point['train_s']:.0f} s)")
    _write_atomic(done_path, json.dumps({"name": candidate.name, "curve": curve}, indent=1))
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # the curve is what a search keeps
    return curve


def rank_curves(rows: Sequence[Mapping[str, Any]], step: int, set_name: str, metric: str) -> list[str]:
    """Names ranked best first by `metric` on `set_name` at `step` (lower is better, except top-1 agreement);
    ties keep the given order."""
    sign = -1.0 if metric == "top1_agreement" else 1.0
    return [r["name"] for r in sorted(rows, key=lambda r: sign * _point(r["curve"], step)[set_name][metric])]


def search_markdown(result: SearchResult) -> str:
    """The ranked table (parameters; each set's metrics at the last step; the rank at every scored step)."""
    sets = list(result.teacher)
    last = result.eval_at[-1]
    ranks = {s: result.ranking(s) for s in result.eval_at}
    lines = [f"# Shape search: ranked by {result.rank_by[0]} {result.rank_by[1]} at step {last}", "",
             "| rank | candidate | parameters | non-embedding | "
             + " | ".join(f"{s} CE | {s} KL" for s in sets) + " | rank at steps "
             + ", ".join(map(str, result.eval_at)) + " |",
             "|" + "---|" * (5 + 2 * len(sets))]
    lines.append("| - | teacher | | | " + " | ".join(f"{result.teacher[s]['ce']:.4f} | 0" for s in sets) + " | |")
    for number, row in enumerate(result.rows, start=1):
        point = _point(row["curve"], last)
        cells = " | ".join(f"{point[s]['ce']:.4f} | {point[s]['kl']:.4f}" for s in sets)
        history = ", ".join(str(ranks[s].index(row["name"]) + 1) for s in result.eval_at)
        note = f" ({row['note']})" if row.get("note") else ""
        lines.append(f"| {number} | `{row['name']}`{note} | {_count(row['parameters'])} | "
                     f"{_count(row['non_embedding'])} | {cells} | {history} |")
    stable = all(ranks[s][0] == result.winner for s in result.eval_at[len(result.eval_at) // 2:])
    lines += ["", f"The winner led at every scored step from the middle of the search on: {'yes' if stable else 'no'}."]
    return "\n".join(lines) + "\n"


def plot_search(result: SearchResult, path: str) -> str | None:
    """One panel per held-out set: each candidate's CE against the steps, the teacher's as a line."""
    if len(result.eval_at) < 1:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result.teacher)
    figure, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for axis, name in zip(axes[0], sets):
        for row in result.rows:
            points = sorted(row["curve"], key=lambda p: p["step"])
            axis.plot([p["step"] for p in points], [p[name]["ce"] for p in points], "o-", label=row["name"])
        axis.axhline(result.teacher[name]["ce"], color="black", linestyle="--", label="teacher")
        axis.set_title(f"{name} held-out CE")
        axis.set_xlabel("step")
        axis.legend(fontsize=6)
    figure.tight_layout()
    tmp = path + ".tmp.png"
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    os.replace(tmp, path)
    return path


def _point(curve: Sequence[Mapping[str, Any]], step: int) -> Mapping[str, Any]:
    for point in curve:
        if point["step"] == step:
            return point
    raise KeyError(f"no score at step {step} (scored at {[p['step'] for p in curve]}).")


def _summary(summary: Mapping[str, Any]) -> dict[str, float]:
    return {k: round(float(summary[k]), 5) for k in METRICS} | {"tokens": int(summary["tokens"])}


def _count(value: int | None) -> str:
    return "" if value is None else f"{value / 1e6:.1f}M"


def _folder_name(name: str) -> str:
    """A candidate's folder: its name with anything but letters, digits, '=', '.', '-' and '_' replaced, so a name
    never leaves `directory`."""
    safe = re.sub(r"[^A-Za-z0-9=._-]+", "_", name).strip("._") or "candidate"
    return safe[:120]


def _write_atomic(path: str, text: str) -> None:
    """Written beside `path`, flushed to disk, then renamed onto it: a kill or a full disk leaves the old file."""
    atomic_bytes(path, text.encode())
