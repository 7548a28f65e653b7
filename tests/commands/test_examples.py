"""Every example the command line shows (each subcommand's --help) and every command line in the README is read
by the parser that would run it (`nnx-surgery` subcommands by cli.parse, `compress` and the recipe's script by the
recipe's parser): no renamed, unknown or abbreviated flag, no value out of range. Parsing only: nothing runs, no
jax is needed."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from refusal_env import ROOT, cli

RECIPE = ("recipes/gemma_7b_to_2b.py", "nnx-surgery compress")


def readme_command_lines() -> list[str]:
    """The README's command lines: the command table's `nnx-surgery ...` examples, and in code blocks the lines
    that run `nnx-surgery` or the recipe's script (continued lines joined; comments and quoting removed later)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    found = [span for row in text.splitlines() if row.startswith("|")  # the command table: whole commands
             for span in re.findall(r"`(nnx-surgery [^`]+)`", row)]
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            starts = [line.find(marker) for marker in RECIPE if marker in line]
            start = min(starts) if starts else 0 if line.startswith("nnx-surgery ") else -1
            if start >= 0 and "nnx_surgery.evaluation.lm_eval_backend" not in line:
                found.append(line[start:].rstrip('"'))
    return found


def argv_of(line: str) -> tuple[str, list[str]]:
    """(which parser, its arguments) of a command line: "cli" for a subcommand, "recipe" for compress and the
    script; an elided part ("...") and a trailing comment are dropped."""
    words = shlex.split(line.replace("...", " "), comments=True)
    if words[0].endswith("gemma_7b_to_2b.py"):
        return "recipe", words[1:]
    words = words[1:]  # nnx-surgery
    return ("recipe", words[1:]) if words[0] == "compress" else ("cli", words)


def parsed(kind: str, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of parsing `argv`; 0 when it is read."""
    from nnx_surgery.recipes.config.command_line import build_recipe_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.parse(argv) if kind == "cli" else build_recipe_parser(prog="nnx-surgery compress").parse_args(argv)
        except SystemExit as stop:
            return int(stop.code or 0), err.getvalue()
    return 0, err.getvalue()


HELP_EXAMPLES = [(name, example) for name, (_, _, examples, _) in cli.COMMANDS.items() for example in examples]
README_LINES = readme_command_lines()


@pytest.mark.parametrize("name,example", HELP_EXAMPLES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(HELP_EXAMPLES)])
def test_every_help_example_parses(name, example):
    code, err = parsed(*argv_of(f"nnx-surgery {example.split('   (')[0]}"))
    assert code == 0, f"nnx-surgery {example}: {err}"


@pytest.mark.parametrize("line", README_LINES, ids=[str(i) for i in range(len(README_LINES))])
def test_every_readme_command_line_parses(line):
    code, err = parsed(*argv_of(line))
    assert code == 0, f"{line}: {err}"


def test_the_readme_shows_command_lines_and_a_wrong_one_is_caught():
    """The extraction finds the README's commands (the table's nine at least), and a renamed or abbreviated flag
    in one would fail the test above."""
    assert len(README_LINES) >= 20 and sum(line.startswith("nnx-surgery ") for line in README_LINES) >= 9
    for line in ("nnx-surgery generate student/ --prompt x --temperature 0.8",
                 "nnx-surgery eval --teacher T s/ --output e/ --task nnx_offline",
                 "nnx-surgery compress --preset tiny --output runs/tiny --lr 3",
                 "python recipes/gemma_7b_to_2b.py --stps 3"):
        assert parsed(*argv_of(line))[0] == 2, line
