"""The suite's result as Markdown (suite.md) and JSON (suite.json): the metrics table, the held-out sets with their
intervals, what the columns count, and every model's continuation of each prompt."""
from __future__ import annotations

import json
import os

from nnx_surgery.distill.distributed import is_main_process
from nnx_surgery.evaluation.heldout_sets import report_markdown
from nnx_surgery.evaluation.cross_vocab import trimmed_note_lines


COLUMNS = (("parameters", "parameters", "{:,}"), ("loss", "held-out CE (nats)", "{:.4f}"),
           ("perplexity", "perplexity", "{:.3f}"), ("top1_agreement", "top-1 agreement", "{:.2%}"),
           ("kl", "KL(ref || model)", "{:.4f}"), ("bleu", "BLEU", "{:.1f}"), ("rouge_l", "ROUGE-L", "{:.1f}"),
           ("mc_accuracy", "next-line MC acc.", "{:.2%}"), ("mc_accuracy_unnormalised", "MC acc. (sum)", "{:.2%}"),
           ("loop_share", "looping continuations", "{:.0%}"), ("distinct_2", "distinct-2", "{:.3f}"))


def suite_markdown(result: dict) -> str:
    """The suite's result as Markdown: a metrics table (one row per model) and the sample continuations."""
    reference, mc = result["reference"], result["multiple_choice"]
    columns = [c for c in COLUMNS if any(c[0] in row for row in result["models"].values())]
    lines = ["| model | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, row in result["models"].items():
        cells = ["(reference)" if row.get(key) is None and name == reference else
                 "-" if row.get(key) is None else form.format(row[key]) for key, _, form in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if result.get("sets"):
        lines += ["", "## Held-out sets", ""]
        for report in result["sets"].values():
            lines += [report_markdown(report, reference), ""]
    lines += ["", f"Agreement, KL, BLEU and ROUGE-L (F1 x100) are against `{reference}` on held-out text; BLEU and "
                  f"ROUGE-L compare greedy continuations of {len(result['samples'])} held-out prompts "
                  f"({result['settings']['new_tokens']} new tokens). Multiple choice: {mc['items']} items, the "
                  f"true next line among {mc['choices']} candidates, scored by {mc['scored_by']}; chance "
                  f"{mc['chance']:.2%}.", *degeneration_note(result), *trimmed_note_lines(result), "",
              "## Sample generations", ""]
    for number, sample in enumerate(result["samples"], start=1):
        where = f"held-out document {sample['document']}, continued from line {sample['line'] + 1}"
        lines += [f"### Prompt {number} ({where})", "",
                  _fenced(sample["prompt"]), ""]
        for name, text in sample["continuations"].items():
            lines += [f"**{name}**", "", _fenced(text), ""]
    return "\n".join(lines)


def degeneration_note(result: dict) -> list[str]:
    """The sentence that says what the degeneration columns count (absent from results made before them)."""
    rule = result.get("degeneration")
    if not rule:
        return []
    return [f"Looping continuations: the share of the {rule['continuations']} greedy continuations in which "
            f"{rule['loop']} ({rule['units']}); distinct-2: distinct word bigrams over all of them, pooled. The "
            f"reference's own rates are the yardstick (code repeats itself legitimately)."]


def _fenced(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}\n{text.rstrip()}\n{fence}"


def write_suite(result: dict, out_path: str | os.PathLike) -> str:
    """Write `result` as Markdown at `out_path` and as JSON beside it (`.json`); returns the Markdown path.
    Multi-host: only process 0 writes (the run folder is shared storage); the others return the path."""
    path = os.fspath(out_path)
    if not is_main_process():
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(suite_markdown(result) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return path


__all__ = ["COLUMNS", "suite_markdown", "degeneration_note", "write_suite"]
