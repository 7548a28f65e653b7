"""Atomic publication of folders and files: a crash, a kill or a full disk never leaves one that looks complete.

A folder is written under a hidden temporary name beside its destination (`.name.partial-<host>-<pid>-*`),
fsynced, and renamed into place at the end; an existing folder is replaced only when asked, in one atomic
exchange where the system has one. Temporaries of writers that died are cleaned up by the next writer.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from typing import Iterator

import numpy as np

from nnx_surgery.surgery.families.errors import CheckpointError


@contextlib.contextmanager
def atomic_folder(out_dir: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary folder beside `out_dir`; on success it replaces `out_dir` in one rename.

    An existing non-empty `out_dir` is refused unless `overwrite=True`; it is then swapped out in one atomic
    exchange (renameat2 RENAME_EXCHANGE; two renames where the file system lacks it) and deleted. Files are
    fsynced before the rename, so even a power cut leaves either the old folder or the complete new one. On any
    failure the temporary folder is removed and `out_dir` is left as it was; temporaries of writers that were
    killed (SIGKILL, OOM) are removed by the next save to the same place."""
    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.split(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a folder; choose another output path.")
    os.makedirs(parent, exist_ok=True)
    clean_leftovers(parent, base)
    if not overwrite and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it (it is "
                              "swapped out only once the new folder is complete), or choose another folder.")
    tmp = tempfile.mkdtemp(prefix=temp_prefix(base, "partial"), dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a published model folder should not be
        yield tmp
        _fsync_tree(tmp)
        if os.path.exists(out_dir) and _exchange(tmp, out_dir):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous folder
        else:
            _replace_folder(tmp, out_dir, parent, base)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_folder(tmp: str, out_dir: str, parent: str, base: str) -> None:
    """Two renames (no atomic exchange here): a writer killed between them leaves `.base.old-*`, which the next
    `atomic_folder` on this path puts back."""
    old = None
    if os.path.exists(out_dir):
        old = os.path.join(parent, f"{temp_prefix(base, 'old')}{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old:
            os.replace(old, out_dir)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs)


def _short_base(base: str, room: int) -> str:
    """`base`, or when its UTF-8 is longer than `room` bytes its start and a hash of the whole (the same for the
    same name, so that the next writer finds a dead one's temporaries)."""
    if len(os.fsencode(base)) <= room:
        return base
    digest = hashlib.sha256(os.fsencode(base)).hexdigest()[:12]
    head = os.fsencode(base)[:max(0, room - 13)].decode("utf-8", "ignore")
    return f"{head}~{digest}"


def temp_prefix(base: str, kind: str, host: str | None = None, *, owner: bool = True) -> str:
    """The name a temporary beside `base` starts with, `.base.KIND-HOST-PID-` (mkstemp/mkdtemp add 8 random
    characters; `owner` False: up to HOST-, what any writer's starts with): a long `base` is shortened
    (`_short_base`, room kept for a 10-digit pid) so that the whole stays a valid name, whatever name the file
    system allows for the output itself."""
    host = socket.gethostname() if host is None else host
    tail = f".{kind}-{host}-"
    start = "." + _short_base(base, NAME_MAX - 1 - len(os.fsencode(tail)) - len("0123456789-") - 8) + tail
    return f"{start}{os.getpid()}-" if owner else start


def clean_leftovers(parent: str, base: str) -> None:
    """Remove `.base.partial-*` (folders, or files of `atomic_file`) of this host's dead writers; restore a
    `.base.old-*` a dead writer left when the folder itself is missing."""
    host = socket.gethostname()
    for kind in ("old", "partial"):
        prefix = temp_prefix(base, kind, host, owner=False)  # `.base.KIND-HOST-`: its pid follows
        for name in sorted(os.listdir(parent)):
            pid = name[len(prefix):].split("-")[0]
            if not name.startswith(prefix) or not pid.isdigit() or _alive(int(pid)):
                continue
            path, out_dir = os.path.join(parent, name), os.path.join(parent, base)
            if kind == "old" and not os.path.exists(out_dir):
                os.replace(path, out_dir)
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:  # a file's temporary (atomic_file)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[str]:
    """A temporary file beside `path` (`.name.partial-<host>-<pid>-*`), renamed onto it (fsynced first) when the
    block succeeds, removed when not; temporaries of this host's writers that died (SIGKILL, a power cut) are
    removed by the next write to the same path."""
    parent, base = os.path.split(os.path.abspath(path))
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder; give the path of the file to write.")
    try:
        os.makedirs(parent, exist_ok=True)
        clean_leftovers(parent, base)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(base, "partial"), dir=parent)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot write in {parent} ({err.strerror}); choose a path in a writable "
                              "folder.") from None
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a published file should not be
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str, data, *, indent: int | None = 2) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def missing_folders(path: str) -> list[str]:
    """`path` and its parents that do not exist yet, deepest first: what writing `path` creates, and so what a
    command that fails before writing anything removes again."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing
