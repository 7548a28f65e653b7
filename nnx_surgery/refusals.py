"""The toolkit's refusals as one line: `RecipeError`, the errors that are the user's to fix (`USER_ERRORS`), and
`guarded`, which runs a command's `main` and turns them, what the file system refuses, Ctrl-C and SIGTERM into one
line on stderr and an exit code, with any secret the command was given masked (nnx_surgery/secrets.py)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import traceback
from typing import Callable

from nnx_surgery import distill
from nnx_surgery import export
from nnx_surgery import surgery
from nnx_surgery.distill.distributed import DistributedError
from nnx_surgery.distill.inputs.cache_format import CacheError
from nnx_surgery.distill.mesh import MeshError
from nnx_surgery.distill.loop.trainer import DivergenceError
from nnx_surgery.secrets import VARIABLE_NAME, looks_like_token, redact
from nnx_surgery.signals import (OWN_PROCESS, Stopped, Terminated, by_sigterm, exit_now, ignore_signals,
                                 raised_in_main_thread)


class RecipeError(ValueError):
    """A flag or an output folder the recipe cannot work with; the message says which and how to fix it."""


# The toolkit's own refusals: printed as one line (exit 2); anything else is a bug and keeps its traceback.
USER_ERRORS = (RecipeError, surgery.ConfigError, surgery.CheckpointError, surgery.SpecError, surgery.PlanError,
               export.HubError, distill.DataError, MeshError, DivergenceError, DistributedError, CacheError,
               OSError)


NOTHING_WRITTEN = "nothing was written (temporary files are removed); run the same command again."


def guarded(main: Callable[[list[str] | None], object], argv: list[str] | None = None, *,
            resumable: bool = True, stopped: str = NOTHING_WRITTEN) -> None:
    """Run a script's `main`: the toolkit's errors and what the file system refuses (a full disk or size limit,
    a read-only file system, a name too long, a path through a file; `REFUSED_PATHS`) become one line on stderr
    and exit code 2 (`--debug` keeps the traceback); Ctrl-C exits with 130 after saying how to resume
    (`resumable`: the command has --resume; else `stopped` says what is left), SIGTERM like Ctrl-C with 143
    (temporaries are removed on the way out, as on any error), and a signal while stopping is ignored. Any other
    error is a bug and keeps its traceback (exit 1). Every message, traceback included, has the secrets the
    command could echo masked (--token-env's value, a token in the environment). `argv` None: the process's own
    command line, which `exit_now` ends without the interpreter's shutdown."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        with raised_in_main_thread(), _quiet_about_a_full_disk():
            main([a for a in args if a != "--debug"])
    except KeyboardInterrupt as stop:  # distill.RunInterrupted names the step it saved
        ignore_signals()  # a second Ctrl-C while stopping must not interrupt the way out
        code = 143 if by_sigterm(stop) else 130
        what = "terminated (SIGTERM)" if code == 143 else "interrupted"
        if isinstance(stop, Stopped):  # the command says what it left
            text = f"{what}; {redact(stop.advice, args)}"
        elif resumable:
            text = ("" if isinstance(stop, Terminated) else redact(str(stop), args)) or \
                f"{what}; rerun the same command with --resume to continue from the last checkpoint."
        else:  # the command has no --resume: it publishes its output only once complete
            text = f"{what}; {stopped}"
        print(text, file=sys.stderr)
        exit_now(code, own_process=argv is None)
    except (SystemExit, GeneratorExit):
        raise
    except Exception as error:
        if not isinstance(error, USER_ERRORS) and not full_disk(error):  # a bug: its traceback (exit 1), masked
            print(redact(traceback.format_exc(), args), end="", file=sys.stderr)
            sys.exit(1)
        if debug:
            print(redact(traceback.format_exc(), args), end="", file=sys.stderr)
        print(f"error: {redact(_one_line(error), args)}", file=sys.stderr)
        if not debug:
            print("(run again with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def _quiet_about_a_full_disk():
    """While the command runs, what background writers print about a full disk is left to the one line that says
    it: orbax's threads log the failed write (absl, with its traceback) and, their event loop closed under them,
    report unraisable RuntimeErrors; anything else is printed as before."""
    previous = sys.unraisablehook

    def unraisable(report):
        if not (isinstance(report.exc_value, RuntimeError) and "Event loop is closed" in str(report.exc_value)):
            previous(report)

    def keep(record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not _size_limit_text(text)

    loggers = [logging.getLogger(name) for name in ("absl", "orbax")]
    sys.unraisablehook = unraisable
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        sys.unraisablehook = previous
        for logger in loggers:
            logger.removeFilter(keep)


FULL_DISK = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# what the file system refuses besides a full disk, and what to do about it
REFUSED_PATHS = {errno.EROFS: "the file system is read-only; choose an output on a writable one",
                 errno.ENAMETOOLONG: "a name in the path is longer than the file system allows (255 bytes); "
                                     "choose a shorter name",
                 errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
                 errno.ELOOP: "the path runs through a loop of symbolic links; choose another path",
                 errno.EEXIST: "a file is in the way of a folder to be made; choose another path",
                 errno.EISDIR: "a folder is where a file belongs; choose another path",
                 errno.EACCES: "permission denied; choose a path you may use",
                 errno.EPERM: "the operation is not permitted there; choose another path"}


def wrong_kind(path: str, wanted: str) -> str:
    """Why `path` is no `wanted` ("file" or "folder"): there is nothing there, or what is there instead."""
    if os.path.islink(path) and not os.path.exists(path):
        return "a symbolic link to nothing (dangling, or a loop)"
    if not os.path.exists(path):
        return f"no such {wanted}"
    if os.path.isdir(path):
        return "is a folder, not a file"
    if os.path.isfile(path):
        return "is a file, not a folder"
    return "is not a regular file or folder (a pipe, socket or device)"


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    number = getattr(error, "errno", None)
    where = getattr(error, "filename", None)
    if isinstance(error, FileNotFoundError) and where:
        text = f"no such file or folder: {where}"
    elif full_disk(error):  # in an OSError's errno, or in words (`_size_limit_text`)
        text = (f"the disk is full or a file size limit was reached{f' writing {where}' if where else ''} "
                f"({_full_disk_cause(error)}); nothing was replaced and the temporary files are removed: free "
                "space, or choose another output.")
    elif isinstance(error, OSError) and number in REFUSED_PATHS:
        text = f"{where or 'a path'}: {error.strerror}: {REFUSED_PATHS[number]}."
    elif isinstance(error, OSError) and number is not None:
        text = f"{where or 'a path'}: {error.strerror or text}; check the path and the file system, then run again."
    name = type(error).__name__
    return " ".join(f"{name}: {text}".split())


def _full_disk_cause(error: BaseException) -> str:
    """The C library's words for the full disk `error` (or an error it was raised from) reports."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_DISK:
            return seen.strerror or os.strerror(seen.errno)
        found = FULL_DISK_TEXT.search(str(seen))
        if found:
            code = found.group(0)
            return os.strerror(int(code.split("'")[1])) if code.startswith("os_error_code") else code
        seen = seen.__cause__ or seen.__context__
    return "no space left"


def full_disk(error: BaseException) -> bool:
    """`error` is a full disk or a file size limit (ENOSPC, EFBIG, EDQUOT, or a short write saying so), or one
    raised while handling such an error."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_DISK or _size_limit_text(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# a full disk in another library's words: tensorstore's (orbax's checkpoints) os_error_code, the C library's text
FULL_DISK_TEXT = re.compile("|".join([*(f"os_error_code='{n}'" for n in FULL_DISK), *map(re.escape, (
    os.strerror(n) for n in FULL_DISK))]))


def _size_limit_text(text: str) -> bool:
    """A write cut short, said in words rather than an OSError's errno: tempfile's "No usable temporary directory",
    numpy's "N requested and M written" (ndarray.tofile under a size limit), tensorstore's error codes."""
    return "No usable temporary directory" in text or ("requested and" in text and "written" in text) or \
        FULL_DISK_TEXT.search(text) is not None


__all__ = ["RecipeError", "USER_ERRORS", "guarded", "redact", "looks_like_token", "VARIABLE_NAME", "FULL_DISK",
           "REFUSED_PATHS", "exit_now", "Terminated", "Stopped", "by_sigterm", "wrong_kind", "full_disk",
           "OWN_PROCESS"]
