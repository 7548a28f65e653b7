"""The Tunix peer's own virtual environment, created on first use and reused after.

google-tunix 0.1.7 pins `safetensors<0.8` while transformers 5 (in the project's venv) needs `>=0.8`, so the two
cannot share an environment. `ensure_tunix_python()` returns the interpreter of `bench/.venv-tunix` (gitignored),
creating it with `python3 -m venv` and pip when it is missing (about 90 s; pip's own index settings apply).
Tunix is an optional dependency of `bench/` only, never of the package.
"""
from __future__ import annotations

import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(BENCH, ".venv-tunix")
# jax is not declared by google-tunix (only flax); pin the same jax as the project's venv so XLA is the same.
REQUIREMENTS = ["google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8", "optax==0.2.8"]
STAMP = os.path.join(VENV, ".bench-ready-" + "-".join(r.replace("==", "") for r in REQUIREMENTS[:1]))


def tunix_python() -> str:
    return os.path.join(VENV, "bin", "python")


def ensure_tunix_python(quiet: bool = True) -> str:
    """Path of the Tunix venv's python, creating the venv first when needed. Raises RuntimeError on failure."""
    python = tunix_python()
    if os.path.exists(STAMP) and os.path.exists(python):
        return python
    base = os.environ.get("TUNIX_BASE_PYTHON", "python3")
    steps = [[base, "-m", "venv", VENV],
             [python, "-m", "pip", "install", *(["-q"] if quiet else []), *REQUIREMENTS]]
    for cmd in steps:
        print(f"[tunix_env] {' '.join(cmd)}", file=sys.stderr, flush=True)
        result = subprocess.run(cmd)
        if result.returncode:
            raise RuntimeError(f"creating the Tunix peer's venv failed at `{' '.join(cmd)}` (exit "
                               f"{result.returncode}); delete {VENV} and retry, or run without the Tunix peer "
                               "(--peers ours,torch).")
    check = subprocess.run([python, "-c", "import tunix.distillation, safetensors; print(safetensors.__version__)"],
                           capture_output=True, text=True)
    if check.returncode:
        raise RuntimeError(f"the Tunix venv at {VENV} does not import tunix.distillation:\n{check.stderr[-2000:]}")
    open(STAMP, "w").close()
    return python


if __name__ == "__main__":
    print(ensure_tunix_python(quiet=False))
