"""The degeneration measures of the suite: loops in greedy continuations and distinct-2, on crafted texts."""
from __future__ import annotations

import pytest

from nnx_surgery.evaluation.degeneration import LoopRule, degeneration, distinct_n, has_loop, text_units
from nnx_surgery.evaluation.suite_report import suite_markdown

LOOP = "print(folder)\n    print(folder)\n    print(folder)\n"
CLEAN = ('def fibonacci(n):\n    """Return the nth Fibonacci number."""\n    a, b = 0, 1\n'
         "    for _ in range(n):\n        a, b = b, a + b\n    return a\n")


def test_units_are_words_and_single_punctuation_marks():
    assert text_units("print(folder)\n") == ["print", "(", "folder", ")"]
    assert text_units("a+=b") == ["a", "+", "=", "b"]


def test_a_repeated_line_is_a_loop_and_clean_code_is_not():
    assert has_loop(LOOP)  # "print ( folder )" three times
    assert not has_loop(CLEAN)
    assert not has_loop(LOOP, times=4)
    assert has_loop("a b a b a b", n=2, times=3)  # overlapping occurrences are counted


def test_twice_is_not_a_loop_but_three_times_is():
    assert not has_loop("x = f(y)\nx = f(y)\n")
    assert has_loop("x = f(y)\nx = f(y)\nx = f(y)\n")


def test_an_empty_continuation_has_no_loop_and_no_bigram():
    assert not has_loop("")
    assert distinct_n([""]) is None
    assert degeneration([]) == {"loop_share": None, "distinct_2": None, "continuations": 0}


def test_distinct_2_pools_bigrams_over_continuations():
    assert distinct_n(["a b c"]) == 1.0  # (a b), (b c)
    assert distinct_n(["a b a b"]) == pytest.approx(2 / 3)  # (a b) twice, (b a) once
    assert distinct_n(["a b", "a b"]) == 0.5  # the same bigram in two continuations counts once
    assert distinct_n(["a b", ""]) == 1.0  # an empty one adds nothing


def test_degeneration_of_a_model_s_continuations():
    result = degeneration([LOOP, CLEAN, "", LOOP])
    assert result["loop_share"] == 0.5 and result["continuations"] == 4
    assert 0 < result["distinct_2"] < distinct_n([CLEAN])  # the loops repeat their bigrams


def test_the_rule_is_checked():
    with pytest.raises(ValueError, match="times"):
        has_loop("a", times=1)
    assert LoopRule().describe() == "some 4-gram 3+ times"


def test_suite_markdown_shows_both_columns_and_what_they_count():
    result = {"reference": "teacher", "multiple_choice": {"items": 0, "choices": 4, "chance": 0.25,
                                                          "scored_by": "x"},
              "settings": {"new_tokens": 8}, "samples": [],
              "degeneration": {"loop": "some 4-gram 3+ times", "units": "words", "continuations": 2},
              "models": {"teacher": {"loop_share": 0.0, "distinct_2": 0.9},
                         "student": {"loop_share": 0.5, "distinct_2": 0.4}}}
    text = suite_markdown(result)
    assert "| looping continuations | distinct-2 |" in text
    assert "| teacher | 0% | 0.900 |" in text and "| student | 50% | 0.400 |" in text
    assert "some 4-gram 3+ times" in text
