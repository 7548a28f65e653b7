"""Evaluation of students: held-out loss and perplexity, held-out sets with intervals, the
suite (several models side by side) and its report, degeneration, and the shape search's
ranking."""
