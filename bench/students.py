"""Teacher/student checkpoint pairs for the distillation benchmarks, made once under bench/out/ckpt and reused.

The teacher is a synthetic checkpoint of a real shape (make_checkpoint.py); the student is cut from it on disk by
the project's own surgery (`plan_student` + `prune_checkpoint`), so every peer trains the same student from the
same files.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from make_checkpoint import ensure_checkpoint  # noqa: E402

# scale -> (teacher shape, config overrides, student sizes (layers, hidden, intermediate, heads, kv heads))
PAIRS = {
    # dispatch-bound: a 6-layer Gemma 3 with a 512-token vocabulary, halved in depth
    "tiny": ("tiny-gemma3", {}, (3, 64, 128, 4, 2)),
    # the peer study's setting (peers_270m.md): Gemma3-270M, 262k vocabulary, 9 of its 18 layers
    "270m": ("gemma-3-270m", {}, (9, 640, 2048, 4, 1)),
    # GPU check: Gemma-2-2B teacher, a pruned ~1B student (depth 13/26, MLP 9216 -> 3072): 1.05B parameters
    "2b": ("gemma-2-2b", {}, (13, 2304, 3072, 8, 4)),
    # its CPU stand-in for gpu.sh's smoke run (same family and code path, tiny sizes)
    "tiny2": ("tiny-gemma2", {}, (2, 64, 64, 4, 2)),
}


def _import(module: str, name: str):
    """A public name from the package root when it is exported there, else from its module."""
    package = __import__(module.split(".")[0], fromlist=[name])
    if hasattr(package, name):
        return getattr(package, name)
    return getattr(__import__(module, fromlist=[name]), name)


def ensure_pair(scale: str, root: str | None = None) -> tuple[str, str]:
    """(teacher folder, student folder) for `scale`, creating what is missing."""
    shape, overrides, sizes = PAIRS[scale]
    root = root or common.CKPT_DIR
    teacher = ensure_checkpoint(shape, os.path.join(root, shape + ("" if not overrides else "-custom")),
                                overrides=overrides)
    student = os.path.join(root, f"{shape}-student-{'-'.join(map(str, sizes))}")
    if not os.path.exists(os.path.join(student, "config.json")):
        plan_student = _import("nnx_surgery.surgery.planning.student_planner", "plan_student")
        prune_checkpoint = _import("nnx_surgery.surgery.pruning.on_disk", "prune_checkpoint")
        StudentSpec = _import("nnx_surgery.surgery.plans.student_spec", "StudentSpec")
        plan = plan_student(teacher, StudentSpec(*sizes), depth="uniform", width="magnitude")
        prune_checkpoint(teacher, plan, student, report=False)
    return teacher, student


if __name__ == "__main__":
    print(ensure_pair(sys.argv[1]))
