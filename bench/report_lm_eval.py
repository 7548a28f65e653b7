"""BENCHMARKS.md's lm-eval section from bench/results/lm-eval-speed.jsonl (bench/lm_eval_speed.py --record): our
lm-eval backend against lm-eval's own `hf` backend, requests per second on the same folder and CPU.

`render()` returns Markdown lines (bench/report.py appends them); `python bench/report_lm_eval.py` prints them.
"""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SPEED_RESULTS = os.path.join(HERE, "results", "lm-eval-speed.jsonl")
SPEED_GOAL = 2.0  # ours at least twice the hf backend's warm requests per second on the same CPU


def read(path: str = SPEED_RESULTS) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def latest_real(records: list[dict]) -> dict | None:
    real = [r for r in records if r.get("model") == "real"]
    return real[-1] if real else None


def target_rows(records: list[dict] | None = None) -> list[tuple[str, str, bool]]:
    """"Targets at a glance": the real 270M's warm ratio per request type (the slower type decides)."""
    record = latest_real(read() if records is None else records)
    if record is None:
        return []
    worst = min(record["kinds"], key=lambda k: k["ratio_warm"])
    text = ", ".join(f"{k['kind']} {k['ratio_warm']:.2f}x" for k in record["kinds"])
    return [(f"lm-eval on the 270M (CPU): >= {SPEED_GOAL:g}x the hf backend's requests/s", text,
             worst["ratio_warm"] >= SPEED_GOAL)]


def render(records: list[dict] | None = None) -> list[str]:
    from lm_eval_speed import table

    records = read() if records is None else records
    if not records:
        return []
    lines = ["## lm-eval: our backend against lm-eval's `hf` backend (CPU)", "",
             "`python bench/lm_eval_speed.py --model real --record bench/results/lm-eval-speed.jsonl`: the same "
             "requests (the offline tasks' next-line (context, choice) pairs for `loglikelihood`; their line "
             "completions for `generate_until`, greedy, until a newline, at most 24 new tokens), the same float32 "
             "folder (the real Gemma 3 270M imported from the GGUF) and batch size, one peer after the other in one "
             "process; the first pass is cold (our compilations, torch's first calls), the last warm. Ratios are "
             "ours over hf within one run.", ""]
    for record in records:
        scoring = f" Our scoring then: {record['scoring']}." if record.get("scoring") else ""
        lines += [f"Run {record['date']}: {record['model']} model, batch {record['batch']}, {record['passes']} "
                  f"passes, {record['cpus']} CPUs.{scoring}", ""] + table(record) + [""]
    rows = target_rows(records)
    if rows:
        name, text, met = rows[0]
        lines += [f"**Target ({name}):** {'met' if met else 'not met'} ({text}, warm).", ""] + \
            WHY.splitlines() + [""]
    return lines


# What the quiet runs of 2026-12-06 show, and the profile behind them (one batch of 8 rows, the real 270M, float32)
WHY = """Why, on this CPU (a profile of one batch of 8 x 128 tokens, the same weights, quiet machine): the two
decoder stacks run at the same speed (ours 0.99 s, transformers 0.96 s; at 8 x 1024 ours is slower, 16.6 s against
11.5 s: its attention is not fused like torch's SDPA). Our lead in `loglikelihood` comes from doing less work: the
`hf` backend runs context + continuation once per choice and applies the 262k-piece LM head at every position
(1.38 s of its 2.34 s for that batch); ours runs a question's shared context once into a KV cache that every
choice continues, and applies the head only at the continuations' real positions (not their padding to a length
bucket). The first run of the day, without either (the head at every padded continuation position, the context
once per choice), measured 1.35x; sharing the context alone, 1.50x. Greedy generation decodes one token per step
for the whole batch, and each step reads every weight once (about 1.1 GB in float32, two thirds of it the head):
both backends are bound by the same bytes per step at the same batch, and no 2x without a larger batch. Ours takes
fewer steps: a one-character stop string (the task's "\\n") ends its row inside the decode loop, so a batch of 8
stops with its last row (67 steps for the 32 requests against 85 when the text was looked at every 16 steps; the
`hf` backend also stops with its last row but runs each step a little slower here). An
earlier run on a loaded machine gave 2.6x / 2.3x: torch's threads lose more to other work than XLA's do, which is
not a speed of ours."""
