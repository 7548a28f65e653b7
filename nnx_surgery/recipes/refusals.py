"""The toolkit's refusals as one line: `RecipeError`, the errors that are the user's to fix (`USER_ERRORS`), and
`guarded`, which runs a command's `main` and turns them, a full disk, Ctrl-C and SIGTERM into one line on stderr
and an exit code, with any secret the command was given masked."""
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
from nnx_surgery.distill.distributed import DistributedError
from nnx_surgery.distill.inputs.cache_format import CacheError
from nnx_surgery.distill.mesh import MeshError
from nnx_surgery.distill.loop.trainer import DivergenceError

class RecipeError(ValueError):
    """A flag or an output folder the recipe cannot work with; the message says which and how to fix it."""


# The toolkit's own refusals: printed as one line (exit 2); anything else is a bug and keeps its traceback.
USER_ERRORS = (RecipeError, surgery.ConfigError, surgery.CheckpointError, surgery.SpecError, surgery.PlanError,
               surgery.HubError, distill.DataError, MeshError, DivergenceError, DistributedError, CacheError,
               FileNotFoundError, PermissionError)


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
    multi-host run it keeps its default effect, as distill.loop.interruption.StopSignals leaves it there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        from nnx_surgery.surgery.storage.shared_writes import multi_host
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


