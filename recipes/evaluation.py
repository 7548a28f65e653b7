"""The recipe's evaluation: every model of the results table on the same held-out data, and the recovery curves.

Held-out cross-entropy and perplexity for each row; with a tokenizer, `distill.evaluate_suite` adds agreement
and KL to the teacher, greedy continuations scored against the teacher's (BLEU, ROUGE-L), a multiple-choice
task scored by log-likelihood, and the same prompts answered by every model.
"""
from __future__ import annotations

from typing import Any

from distill.evaluate import heldout_loss


def evaluate(args, rows: list[tuple[str, Any, int]], data, out: str) -> dict:
    """`rows`: (name, model, training tokens used). Returns the results dict of results.json."""
    eval_batches = data.eval_batches()[: args.eval_batches]
    results: dict[str, Any] = {"rows": []}
    for name, model, used in rows:
        scores = heldout_loss(model, eval_batches)
        results["rows"].append({"model": name, "parameters": model.config.num_parameters(),
                                "non_embedding_parameters": non_embedding(model.config), "tokens": used,
                                "loss": scores["loss"], "perplexity": scores["perplexity"],
                                "eval_tokens": scores["tokens"]})
    return results


def non_embedding(config) -> int:
    return config.num_parameters() - config.vocab_size * config.hidden_size


def curve(evals: list[dict], args) -> list[dict]:
    """Held-out evaluations of one training run as points: tokens seen, cross-entropy, and (when the run had a
    teacher) KL to it and top-1 agreement."""
    tokens_per_step = args.batch_size * args.seq_len
    points = []
    for record in evals:
        point = {"step": record["step"], "tokens": record["step"] * tokens_per_step,
                 "ce": round(record["student_ce"], 4)}
        for key in ("kl", "top1_agreement"):
            if key in record:
                point[key] = round(record[key], 4)
        points.append(point)
    return points
