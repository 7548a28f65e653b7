"""The installed command line, `nnx-surgery` (also `python -m nnx_surgery`): one subcommand per step a user may
want alone, each a thin layer over the Python API (nnx_surgery/commands/ holds what they run).

    nnx-surgery compress --preset tiny --output runs/tiny             the whole recipe (recipes/gemma_7b_to_2b.py)
    nnx-surgery plan TEACHER --student layers=18,mlp=0.5 --output plan.json
    nnx-surgery prune TEACHER plan.json student/
    nnx-surgery distill TEACHER student/ --output distilled/
    nnx-surgery eval --teacher TEACHER student/ distilled/ --output eval/
    nnx-surgery cache-teacher TEACHER --top-k 64 --output cache/
    nnx-surgery generate distilled/ --prompt "def main("
    nnx-surgery import-gguf model.gguf folder/            nnx-surgery export-gguf folder/ model.gguf
    nnx-surgery push distilled/ me/tiny-student

Errors are one line on stderr and exit code 2 (`--debug` keeps the traceback). Nothing here imports jax: a
subcommand's module is imported when it runs, so `--help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from nnx_surgery import __version__
from nnx_surgery.recipes.config import fields
from nnx_surgery.recipes.config.command_settings import COMMAND_SETTINGS
from nnx_surgery.recipes.config.sections import SECTIONS
from nnx_surgery.secrets import redact

PROG = "nnx-surgery"
DATA_HELP = "training text: files, a folder, a glob ('corpus/*.txt') or hf:NAME"


class Parser(argparse.ArgumentParser):
    """argparse whose refusals look like the toolkit's: one line on stderr naming the flag (secrets masked), exit
    code 2; no abbreviations, so that a near-miss (`--task`) is named as unknown, not read as another flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):

        print(redact(f"error: {message} (see `{self.prog} --help`)", sys.argv[1:]), file=sys.stderr)
        sys.exit(2)


def _shared(group: argparse._ActionsContainer, path: str, help: str | None = None, required: bool = False) -> None:
    """The recipe's flag for the setting at `path` (its declaration in nnx_surgery/recipes/config/sections.py:
    the same name, reading, choices, help and default), stored under its flag's name; `help`: what the setting
    means in this command, where that differs."""
    _add(group, SHARED[path], help, required)


def _own(group: argparse._ActionsContainer, path: str, help: str | None = None, required: bool = False) -> None:
    """A subcommand's own setting at `path` ("generate.max_new_tokens": its declaration in
    nnx_surgery/recipes/config/command_settings.py)."""
    _add(group, OWN[path], help, required)


def _add(group: argparse._ActionsContainer, item: fields.Declared, help: str | None, required: bool) -> None:
    fields.add_option(group, item, help=help, required=required)


def setting_refusals(args: argparse.Namespace) -> list[str]:
    """The declared settings given to a subcommand (the recipe's it shares, and its own), checked as the recipe
    checks them: one line per refusal."""
    own = [item for item in OWN.values() if item.path[0] == args.command]
    return fields.refusals_of(args, [item for item in [*SHARED.values(), *own]
                                     if hasattr(args, fields.option_dest(item))])


SHARED = {item.dest: item for name, kind in SECTIONS.items() for item in fields.declared(kind, (name,)) if item.flag}
OWN = {item.dest: item for name, kind in COMMAND_SETTINGS.items() for item in fields.declared(kind, (name,))}
# flags renamed so that one name has one meaning in every command: (command, old) -> new
RENAMED = {("generate", "--temperature"): "--sample-temperature", ("generate", "--top-k"): "--sample-top-k",
           ("generate", "--top-p"): "--sample-top-p", ("eval", "--tasks"): "--eval-tasks",
           ("eval", "--tasks-limit"): "--eval-tasks-limit",
           ("cache-teacher", "--student"): "--student-folder", ("cache-teacher", "--selection"): "--cache-selection",
           ("push", "--revision"): "--branch", ("distill", "--teacher-cache"): "--teacher-cache-folder",
           ("export-gguf", "--dtype"): "--gguf-type"}


def _data_flags(parser: argparse.ArgumentParser, *, batch: bool = False) -> None:
    group = parser.add_argument_group("data")
    _shared(group, "data.files", help=DATA_HELP)
    _shared(group, "data.corpus_bytes")
    _shared(group, "data.seq_len")
    if batch:
        _shared(group, "data.batch_size")
    _shared(group, "run.seed", help="the data split, order and sampling")


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", metavar="TEACHER", help="a model folder, a .gguf file, gguf:gemma3-270m or a Hub id")
    _shared(p, "student.shape", required=True,
            help="the student's shape: gemma-2b, scaled, layers=18,mlp=0.5 or layers=18,mlp=512,vocab=16384")
    _shared(p, "run.output", required=True, help="where the plan (PLAN.json) is written")
    _shared(p, "surgery.calibration_samples")
    _shared(p, "teacher.revision", help="the Hub revision of a Hub teacher")
    _shared(p, "run.overwrite", help="replace an existing plan file")
    _data_flags(p)


def _prune_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", metavar="TEACHER", help="the teacher the plan was made for (folder or .gguf)")
    p.add_argument("plan", metavar="PLAN.json", help="a plan from `nnx-surgery plan` (or a folder holding plan.json)")
    p.add_argument("output", metavar="OUTPUT", help="the student folder to write")
    _own(p, "prune.dtype")
    _shared(p, "run.overwrite", help="replace a non-empty OUTPUT")


def _distill_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", metavar="TEACHER", help="a model folder, a .gguf file, gguf:gemma3-270m or a Hub id")
    p.add_argument("student", metavar="STUDENT", help="the student folder (e.g. from `nnx-surgery prune`)")
    _shared(p, "run.output", required=True, help="the distilled student's folder")
    for path in ("training.steps", "training.learning_rate", "training.warmup_steps", "training.alpha",
                 "training.temperature", "training.precision"):
        _shared(p, path)
    _own(p, "distill.top_k", help="divergence on the teacher's top-k logits only (less memory; the full vocabulary "
         "is exact); with --teacher-cache-folder at most the cache's K, and the cache's K when not given")
    _own(p, "distill.teacher_cache_folder")
    _shared(p, "run.overwrite", help="replace a non-empty --output")
    _data_flags(p, batch=True)


def _eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("folders", metavar="FOLDER", nargs="+", help="model folders to judge against the teacher")
    _shared(p, "teacher.model", required=True, help="the reference: a folder, a .gguf file or gguf:gemma3-270m")
    _shared(p, "run.output", required=True, help="where suite.md, suite.json and results.json go")
    for path in ("evaluation.tokens", "evaluation.general", "evaluation.prompts", "evaluation.new_tokens",
                 "evaluation.choice_items", "evaluation.tasks", "evaluation.tasks_limit"):
        _shared(p, path)
    for path in ("eval.compare", "eval.include_path", "eval.tasks_batch"):
        _own(p, path)
    _shared(p, "run.overwrite", help="write into a non-empty --output")
    _data_flags(p)


def _generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="FOLDER", help="a model folder with its tokenizer.json")
    _own(p, "generate.prompt", required=True)
    for path in ("generate.max_new_tokens", "generate.truncate_prompt", "generate.sample_temperature",
                 "generate.sample_top_k", "generate.sample_top_p"):
        _own(p, path)
    _shared(p, "run.seed", help="the sampling seed")
    _own(p, "generate.dtype")


def _import_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", metavar="FILE.gguf", help="a GGUF Gemma (e.g. from llama.cpp or `export-gguf`)")
    p.add_argument("output", metavar="OUTPUT", help="the Hugging Face folder to write (must not hold files)")
    _own(p, "import-gguf.dtype")
    _shared(p, "run.overwrite", help="replace a non-empty OUTPUT (swapped out only once the new folder is complete)")


def _export_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="FOLDER", help="a Gemma model folder (what prune, distill, compress write)")
    p.add_argument("output", metavar="OUTPUT.gguf", help="the GGUF file to write")
    _own(p, "export-gguf.gguf_type")
    _shared(p, "run.overwrite", help="replace an existing OUTPUT.gguf")


def _push_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="FOLDER", help="a complete model folder (config.json and safetensors)")
    p.add_argument("repo_id", metavar="REPO_ID", help="user/name or org/name (a bare name goes to the token's user)")
    for path in ("push.public", "push.branch", "push.message", "push.token_env"):
        _own(p, path)


def _cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", metavar="TEACHER", help="a model folder, a .gguf file, gguf:gemma3-270m or a Hub id")
    _own(p, "cache-teacher.top_k", required=True)
    _shared(p, "run.output", required=True, help="the cache folder to write")
    for path in ("cache-teacher.student_folder", "cache-teacher.encoding"):
        _own(p, path)
    _shared(p, "training.cache_selection", help="what the K slots of a token hold: top (the teacher's K most likely "
            "pieces), sampled (K stratified draws of its distribution, each piece with its share of the draws: the "
            "full distribution in expectation; drawn with --seed) or mixed (its top K/2 exactly and K/2 draws of the "
            "rest: also the full distribution in expectation, nearer it per token)")
    _own(p, "cache-teacher.rows_per_shard")
    _shared(p, "training.precision", help="the teacher's weights and compute")
    _shared(p, "training.mesh", help="devices to shard the teacher over, e.g. fsdp=4,tp=2")
    _shared(p, "run.resume", help="continue a partial cache in --output (same settings)")
    _shared(p, "run.overwrite", help="replace a non-empty --output")
    _data_flags(p, batch=True)


# name -> (module:function that runs it, one line, examples, flags)
COMMANDS: dict[str, tuple[str, str, list[str], Callable | None]] = {
    "compress": ("nnx_surgery.recipes.compress_command:entry", "the whole recipe: plan, prune, distil, evaluate, save "
                 "(recipes/gemma_7b_to_2b.py; every flag in `nnx-surgery compress --help`)",
                 ["compress --preset tiny --output runs/tiny",
                  "compress --preset gemma3-270m --output runs/gemma3-270m",
                  "compress --teacher FOLDER --student layers=12,mlp=0.5 --data 'corpus/*.txt' --output runs/x"], None),
    "plan": ("nnx_surgery.commands.surgery_steps:plan", "choose what a student of a given shape keeps of the "
             "teacher, from calibration data, and write the plan as JSON",
             ["plan TEACHER --student layers=18,mlp=0.5 --output plan.json",
              "plan gguf:gemma3-270m --student layers=18,mlp=512,vocab=16384 --data 'corpus/*.txt' -o plan.json"],
             _plan_flags),
    "prune": ("nnx_surgery.commands.surgery_steps:prune", "cut the student a plan describes from the teacher's "
              "files, slice by slice (the teacher is never loaded whole)",
              ["prune TEACHER plan.json student/", "prune TEACHER plan.json student/ --dtype bfloat16"], _prune_flags),
    "distill": ("nnx_surgery.commands.training:distill_student", "train a student on a teacher's outputs (forward KL, "
                "plus hard-label CE when --alpha < 1) and save it",
                ["distill TEACHER student/ --output distilled/",
                 "distill TEACHER student/ --data 'corpus/*.txt' --steps 500 --alpha 0.5 --output distilled/",
                 "distill TEACHER student/ --data 'corpus/*.txt' --teacher-cache-folder cache/ --output distilled/"],
                _distill_flags),
    "cache-teacher": ("nnx_surgery.commands.teacher_cache:cache_teacher", "run the teacher once over the packed "
                      "training rows and write its top-k log-probabilities (checksummed, resumable shards)",
                      ["cache-teacher TEACHER --data 'corpus/*.txt' --top-k 64 --output cache/",
                       "cache-teacher TEACHER --data 'corpus/*.txt' --top-k 64 --output cache/ --resume",
                       "cache-teacher TEACHER --student-folder trimmed/ --data 'corpus/*.txt' --top-k 64 "
                       "--output cache/"],
                      _cache_flags),
    "eval": ("nnx_surgery.commands.training:eval_folders", "judge model folders against a teacher on held-out text "
             "(in-domain and general prose), generations and multiple choice; writes suite.md",
             ["eval --teacher TEACHER student/ distilled/ --output eval/",
              "eval --teacher TEACHER student/ --data 'corpus/*.txt' --eval-prompts 4 --output eval/"], _eval_flags),
    "generate": ("nnx_surgery.commands.models:continue_prompt", "continue a prompt with a model folder (greedy by default)",
                 ["generate student/ --prompt 'def main('",
                  "generate student/ --prompt 'Once' --sample-temperature 0.8 --sample-top-p 0.9 --max-new-tokens 100"],
                 _generate_flags),
    "import-gguf": ("nnx_surgery.commands.models:gguf_to_folder", "write a GGUF Gemma as a Hugging Face folder",
                    ["import-gguf model.gguf folder/", "import-gguf model.gguf folder/ --dtype float32"],
                    _import_flags),
    "export-gguf": ("nnx_surgery.commands.models:folder_to_gguf", "write a Gemma folder as one GGUF file for llama.cpp",
                    ["export-gguf student/ student.gguf", "export-gguf student/ student-f16.gguf --gguf-type f16"],
                    _export_flags),
    "push": ("nnx_surgery.commands.models:push", "upload a model folder to the Hugging Face Hub (private by default)",
             ["push student/ me/tiny-student", "push student/ acme/student --token-env HUB_WRITE --public   "
              "(the variable HUB_WRITE holds a write token)"], _push_flags),
}


# what an interrupted command leaves, where it is not "nothing was written" (nnx_surgery.refusals.guarded)
STOPPED = {"push": "the Hub has this push only if its commit was made; run the same command again (files already "
                   "uploaded are not uploaded again).",
           "generate": "nothing was written."}


def build_parser() -> Parser:
    parser = Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                    description=__doc__.split("\n\n")[0].replace("\n", " "),
                    epilog="examples:\n" + "\n".join(f"  {PROG} {examples[0]}" for _, _, examples, _ in
                                                     COMMANDS.values()) + f"\n\n`{PROG} COMMAND --help` for each.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (_, line, examples, flags) in COMMANDS.items():
        sub = commands.add_parser(name, help=line, description=line[0].upper() + line[1:] + ".",
                                  formatter_class=argparse.RawDescriptionHelpFormatter, add_help=flags is not None,
                                  epilog="examples:\n" + "\n".join(f"  {PROG} {e}" for e in examples))
        if flags is not None:
            flags(sub)
            sub.add_argument("--debug", action="store_true", help="keep the traceback of an error")
    return parser


def _load(target: str) -> Callable:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. The toolkit's refusals exit with code 2 and one line on stderr
    (`nnx_surgery.refusals.guarded`); `compress` is the recipe's own entry (its exit codes too: 3 when --halt-after stops it)."""
    own_process, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "compress":  # the recipe's own flags, --help and exit codes
        entry = _load(COMMANDS["compress"][0])
        _own_process(own_process)
        entry(argv[1:], prog="nnx-surgery compress")
        return 0
    args = parse(argv, parser)
    from nnx_surgery.refusals import guarded  # imports jax: only once a subcommand runs
    run = _load(COMMANDS[args.command][0])
    _own_process(own_process)
    guarded(lambda _: run(args), argv, resumable=False, **({"stopped": STOPPED[args.command]}
                                                          if args.command in STOPPED else {}))
    return 0


def parse(argv: list[str], parser: Parser | None = None) -> argparse.Namespace:
    """The command line of a subcommand (not compress) read and checked as `main` reads it, nothing run: a renamed
    flag, an unknown one, no command or a shared setting out of its range exits 2 with one line."""
    parser = parser or build_parser()
    for (command, old), new in RENAMED.items():
        if argv and argv[0] == command and any(a == old or a.startswith(old + "=") for a in argv[1:]):
            parser.error(f"{command} {old}: renamed {new} (one flag name, one meaning in every command)")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"give a command: {', '.join(COMMANDS)}")
    for error in setting_refusals(args):
        print(redact(f"error: {error} (see `{PROG} {args.command} --help`)", argv), file=sys.stderr)
        sys.exit(2)
    return args


def _own_process(own: bool) -> None:
    """The command runs in a process of its own (not `main([...])` in a caller's): an interrupted run exits without
    the interpreter's shutdown (nnx_surgery.refusals.exit_now)."""
    if own:
        from nnx_surgery import refusals
        refusals.OWN_PROCESS[0] = True


if __name__ == "__main__":
    sys.exit(main())
