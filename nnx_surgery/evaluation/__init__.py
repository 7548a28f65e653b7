"""evaluation: how good a student is, in one package above `distill` (whose data and mesh it uses).

    report = evaluation.evaluate_suite({"teacher": teacher, "student": student}, ...)   # the suite, side by side

Held-out loss and perplexity (perplexity.py), held-out sets with paired intervals (heldout_sets.py) and across
vocabularies (cross_vocab.py), generations and multiple choice (suite_scoring.py, degeneration.py, suite_report.py),
the shape search's ranking (shape_ranking.py), lm-evaluation-harness (lm_eval_backend.py, lm_eval_scoring.py, the
offline tasks in lm_eval_tasks/, their scores in a run: lm_eval_scores.py) and the compress recipe's final
evaluation (final_eval.py)."""
from .perplexity import agreement_and_kl, heldout_loss
from .suite_scoring import (SuiteSettings, continuation_scores, evaluate_suite, heldout_prompts, multiple_choice,
                            multiple_choice_items)
from .heldout_sets import HeldoutSet, heldout_report, paired_interval, score_heldout, summarise
from .shape_ranking import SearchCandidate, SearchResult, rank_curves, search
from .cross_vocab import Vocabulary, heldout_report_across  # judging models whose tokenizers differ

__all__ = ["agreement_and_kl", "heldout_loss", "SuiteSettings", "continuation_scores", "evaluate_suite",
           "heldout_prompts", "multiple_choice", "multiple_choice_items", "HeldoutSet", "heldout_report",
           "paired_interval", "score_heldout", "summarise", "SearchCandidate", "SearchResult", "rank_curves", "search",
           "Vocabulary", "heldout_report_across"]
