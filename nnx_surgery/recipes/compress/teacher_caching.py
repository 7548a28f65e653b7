"""`--teacher-cache`: the teacher's top k read from a cache where the run would otherwise compute it again.

    none     the teacher runs in every distillation step (the default)
    auto     the run writes a cache of the rows a phase reads, then trains the phase from it, where some row is
             read more than once: the shape search (every candidate trains on the same rows, so the teacher runs
             once for all of them instead of once per candidate) and a distillation phase longer than an epoch of
             its data. Written in OUT/teacher_cache/PHASE at --top-k (required), unquantised ("exact"), so a phase
             trains as `--top-k K` does with the teacher running (the same loss code); a resumed run keeps the
             shards already written. A phase that reads each row once runs the teacher: caching would cost the
             forward it saves.
    sampled  (--cache-selection sampled, with auto or always) the cache holds k stratified draws of the
             teacher's distribution per token instead of its top k (distill.inputs.teacher_samples): the full
             distribution in expectation, so not the loss of a --top-k run with the teacher running; auto then
             caches every distillation phase (the draws exist only in a cache).
    always   as auto, in every distillation phase: the teacher's forward moves before the phase (to time the two
             apart, or to keep OUT/teacher_cache/PHASE for later runs of other students on the same rows, which
             read it as a FOLDER).
    FOLDER   a cache written by `nnx-surgery cache-teacher` over this run's data (in the student's tokens when its
             vocabulary is trimmed): every distillation phase reads it, each checked against it first (packing,
             vocabulary, k) and refused in one line when it was made for other rows.

The teacher is still loaded: the recipe prunes it and scores every model against it; a cache saves its forward in
the training steps. Which phases read a cache is recorded in OUT/teacher_cache.json, results.json
("teacher_cache") and results.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax

from nnx_surgery import distill
from nnx_surgery.distill.inputs import topk_cache
from nnx_surgery.distill.inputs.cache_format import CacheError, atomic_json, bytes_per_token
from nnx_surgery.distill.trimmed_vocab import vocab_map_of
from nnx_surgery.refusals import RecipeError
from nnx_surgery.recipes.compress import phase_configs

FOLDER = "teacher_cache"
RECORD = "teacher_cache.json"
SETTINGS = ("none", "auto", "always")


def check_cache_settings(config: Any) -> None:
    """--teacher-cache's value and what it needs, before any model loads: auto needs --top-k; a folder must hold a
    finished cache; the loss may only read the teacher's distribution (a cache holds nothing else)."""
    setting, run = config.training.teacher_cache, config.distill
    if run.teacher_cache is not None:
        raise RecipeError(f"distill.teacher_cache={run.teacher_cache!r}: the recipe sets each phase's cache itself; "
                          "give --teacher-cache (training.teacher_cache) instead.")
    selection = config.training.cache_selection
    if selection != "top" and setting not in SETTINGS[1:]:
        raise RecipeError(f"--cache-selection {selection}: the draws are written into the cache the run makes; "
                          "give --teacher-cache auto or always (a cache-teacher folder holds what its --selection "
                          "wrote).")
    if setting == "none":
        return
    if setting in SETTINGS[1:] and run.top_k is None:
        raise RecipeError(f"--teacher-cache {setting}: a cache holds the teacher's top K of each position; give "
                          "--top-k K (the run then trains on the same loss with or without the cache).")
    if setting not in SETTINGS and not os.path.isfile(os.path.join(setting, topk_cache.MANIFEST)):
        raise RecipeError(f"--teacher-cache {setting}: no finished teacher cache there (no {topk_cache.MANIFEST}); "
                          "give none, auto, always, or a folder written by `nnx-surgery cache-teacher`.")
    needy = sorted(name for name, weight in phase_configs.term_weights(config).items() if weight)
    if needy:  # the config file's stages are checked when their phase opens the cache (distill.loop.cache_replay)
        raise RecipeError(f"--teacher-cache {setting}: --{needy[0].replace('_', '-')}-weight weights a term that "
                          "reads the teacher's hidden states or attention maps, which a cache does not hold; set it "
                          "to 0 or use --teacher-cache none.")
    asked = [name for name, on in (("on-policy steps", run.on_policy.fraction),
                                   ("train_diagnostics", run.train_diagnostics)) if on]
    if asked:
        raise RecipeError(f"--teacher-cache {setting}: {asked[0]} need the teacher itself at every step; use "
                          "--teacher-cache none.")
    try:
        dataclasses.replace(run, teacher_cache=setting)
    except ValueError as error:
        raise RecipeError(f"--teacher-cache {setting}: {error}") from None


def for_phase(run: Any, phase: str, teacher: Any, data: Any, config: Any, mesh: Any = None, *,
              readers: int = 1) -> str | None:
    """The cache folder phase `phase` trains from (written now with auto), or None: the teacher runs. `readers`:
    how many students read the phase's rows (the search's candidates)."""
    setting = run.config.training.teacher_cache
    if setting == "none" or teacher is None:
        return None
    if setting not in SETTINGS:
        _check_teacher(setting, _teacher_folder(run))
        _record(run, phase, setting, written=False)
        return os.path.abspath(setting)
    rows = config.total_steps * config.grad_accum * (config.batch_size or data.batch_size)
    drawn = run.config.training.cache_selection in topk_cache.DRAWN
    if setting == "auto" and readers < 2 and rows <= data.num_rows and not drawn:
        return None  # every row read once: the cache would cost the teacher's forward it saves
    folder = os.path.join(run.folder, FOLDER, phase)
    if os.path.isfile(os.path.join(folder, topk_cache.MANIFEST)):
        return folder  # an earlier run wrote it; the phase checks it when it opens it
    _write(run, phase, teacher, data, config, mesh, folder, rows)
    return folder


def _teacher_folder(run: Any) -> str:
    """The folder of the teacher that teaches: the corrected one after --teacher-correction."""
    if run.config.teacher.correction:
        return os.path.join(run.folder, "phases", "teacher_correction")
    return run.teacher.folder


_CHECKED: set[tuple[str, str]] = set()  # (cache, teacher folder) pairs already compared: hashing weights is slow


def _check_teacher(cache: str, teacher_folder: str) -> None:
    """A given cache was written by this run's teacher (its config.json and weights' hashes), else one line."""
    if (cache, teacher_folder) in _CHECKED:
        return
    try:
        topk_cache.check_written_by(cache, teacher_folder)
    except CacheError as error:
        raise RecipeError(f"--teacher-cache {cache}: {error}") from None
    _CHECKED.add((cache, teacher_folder))


def _write(run: Any, phase: str, teacher: Any, data: Any, config: Any, mesh: Any, folder: str, rows: int) -> None:
    kept = vocab_map_of(config)  # a trimmed student: the cache in its token ids
    identity = {"teacher": topk_cache.folder_identity(_teacher_folder(run)), "vocab_map_sha256": topk_cache.vocab_map_sha256(kept),
                "data": run.data.description, "precision": run.config.training.precision}
    settings = topk_cache.CacheSettings(top_k=config.top_k, encoding="exact", batch_rows=data.batch_size,
                                        selection=run.config.training.cache_selection,
                                        sample_seed=run.config.run.seed)
    row_ids = topk_cache.rows_ahead(data, rows)
    writer = teacher if kept is None else distill.TeacherInStudentVocabulary(teacher, list(kept))
    per_token = bytes_per_token(settings.encoding, config.top_k, int(writer.head_matrix().shape[0])) or 0
    what = topk_cache.slots_text(settings.selection, config.top_k)
    print(f"[{phase}] writing the teacher's {what} over the {len(row_ids):,} rows it reads into "
          f"{folder} (about {len(row_ids) * data.seq_len * per_token / 1e6:,.1f} MB)", flush=True)
    started = time.perf_counter()
    try:
        manifest = topk_cache.write_cache(writer, data, folder, settings, identity=identity, mesh=mesh,
                                          resume=True, row_ids=row_ids)
    except CacheError as error:
        raise RecipeError(f"--teacher-cache {run.config.training.teacher_cache}, phase {phase}: {error}") from None
    _record(run, phase, folder, written=True, seconds=time.perf_counter() - started, manifest=manifest)


def _record(run: Any, phase: str, folder: str, *, written: bool, seconds: float | None = None,
            manifest: dict | None = None) -> None:
    """Add this phase's use of a cache to OUT/teacher_cache.json (what results.json and results.md report; process
    0 writes it on a multi-host run)."""
    if jax.process_index() != 0:
        return
    if manifest is None:
        with open(os.path.join(folder, topk_cache.MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    cached_rows = len(manifest.get("row_ids") or range(manifest["num_rows"]))
    size = sum(entry["bytes"] for entry in manifest.get("shards", []))
    entry = {"folder": os.path.relpath(folder, run.folder) if written else os.path.abspath(folder),
             "written_by_run": written, "top_k": manifest["top_k"], "encoding": manifest["encoding"],
             "selection": manifest.get("selection", "top"),
             "rows": cached_rows, "bytes": size,
             "bytes_per_token": round(size / max(1, cached_rows * manifest["seq_len"]), 1)}
    if seconds is not None:
        entry["write_s"] = round(seconds, 1)
    uses = read_uses(run.folder)
    uses[phase] = {**uses.get(phase, {}), **entry}
    atomic_json(os.path.join(run.folder, RECORD), uses)


def read_uses(out: str) -> dict[str, dict]:
    """OUT/teacher_cache.json: each phase that trained from a cache, and that cache (empty: none did)."""
    path = os.path.join(out, RECORD)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def summary_line(uses: dict[str, dict]) -> str:
    """results.md's sentence on whether (and where) the run trained from a teacher cache."""
    if not uses:
        return "Teacher cache: none; the teacher ran in every distillation step."
    readers: dict[str, list[str]] = {}
    for phase, use in uses.items():
        readers.setdefault(use["folder"], []).append(phase)
    parts = []
    for folder, phases in readers.items():
        use = uses[phases[0]]
        made = (f"written by this run in {use['write_s']:.0f} s" if use.get("write_s") is not None
                else "written by this run" if use["written_by_run"] else "given with --teacher-cache")
        size = f"{use['bytes'] / 1e6:.1f} MB" if use["bytes"] >= 1e5 else f"{use['bytes'] / 1e3:.1f} kB"
        what = topk_cache.slots_text(use.get("selection", "top"), use["top_k"])
        parts.append(f"{', '.join(phases)} read {folder} ({what}, {use['encoding']}, {use['rows']:,} "
                     f"rows, {size}, {use['bytes_per_token']:g} bytes per token; {made})")
    return "Teacher cache: " + "; ".join(parts) + ". Other phases ran the teacher."


__all__ = ["FOLDER", "RECORD", "check_cache_settings", "for_phase", "read_uses", "summary_line"]
