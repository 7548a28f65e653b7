"""`make demo`: the main job sized for the machine. A short-lived probe process asks JAX which devices it sees;
with a TPU or a GPU the demo runs the `gemma3-270m-tpu` preset (100x the CPU demo's tokens, bf16) into
runs/gemma3-270m-tpu, otherwise the `gemma3-270m` preset exactly as the Makefile ran it before (same flags, same
folder runs/gemma3-270m). One line says which preset and why; then this process becomes the recipe (exec: its
output, exit code and signals are the recipe's own).

    python -m nnx_surgery.recipes.demo_choice                 # choose, say why, run
    python -m nnx_surgery.recipes.demo_choice --print-command # choose, say why, print the command, stop

The probe runs apart because a process that has started JAX on a TPU holds the chip: the recipe must be the first
to open it. This module imports no jax.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys

RECIPE = os.path.join("recipes", "gemma_7b_to_2b.py")
# every model is also scored on two of the offline lm-eval tasks, 20 documents each (Makefile, `demo`)
LM_EVAL = ("--eval-tasks", "nnx_stdlib_next_line,nnx_stdlib_complete", "--eval-tasks-limit", "20")
CPU_PRESET, ACCELERATOR_PRESET = "gemma3-270m", "gemma3-270m-tpu"
ACCELERATORS = {"tpu": "a TPU", "gpu": "a GPU", "cuda": "a GPU", "rocm": "a GPU"}
# what JAX's devices are, and how many TPU chips its own PCI scan finds (they show even where no libtpu is loaded)
# (JAX's private helper, the scan its TPU start-up does; a JAX without it reads as no chips)
PROBE = "\n".join([
    "import json, jax",
    "try:",
    "    from jax._src import hardware_utils",
    "    chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]",
    "except (ImportError, AttributeError, OSError):",
    "    chips = 0",
    "d = jax.devices()",
    "print(json.dumps([d[0].platform, getattr(d[0], 'device_kind', ''), len(d), chips]))"])
# `make`'s side folder (Makefile: libtpu off the import path, so that a CPU machine never starts a TPU runtime)
SIDE_LIBTPU = os.path.join("libtpu", "libtpu", "libtpu.so")


@dataclasses.dataclass(frozen=True)
class Backend:
    """What JAX sees: the default backend's platform (cpu, tpu, gpu), its device kind, how many devices, the TPU
    chips on the PCI bus, and the environment that made it see them (the libtpu side folder's, or none)."""

    platform: str
    kind: str
    count: int
    tpu_chips: int = 0
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Choice:
    preset: str
    output: str
    why: str  # the one line printed
    env: tuple[tuple[str, str], ...] = ()  # set for the recipe (the side folder's libtpu)

    def command(self, python: str = sys.executable) -> list[str]:
        """The recipe's command line: for the CPU preset, the one the Makefile has always run."""
        return [python, RECIPE, "--preset", self.preset, "--output", self.output, "--resume", *LM_EVAL]


def choose(backend: Backend) -> Choice:
    """The accelerator preset where JAX sees a TPU or a GPU, the CPU demo otherwise."""
    plural = "device" if backend.count == 1 else "devices"
    if backend.platform in ACCELERATORS:
        what, kind = ACCELERATORS[backend.platform], backend.kind
        if kind:  # "a TPU v5 lite"; "a GPU: NVIDIA H100 80GB HBM3"
            what = f"a {kind}" if kind.lower().startswith(backend.platform) else f"{what}: {kind}"
        where = "; libtpu from the side folder" if backend.env else ""
        return Choice(ACCELERATOR_PRESET, f"runs/{ACCELERATOR_PRESET}",
                      f"[demo] preset {ACCELERATOR_PRESET}: JAX sees {what} ({backend.count} {plural}{where})",
                      backend.env)
    return Choice(CPU_PRESET, f"runs/{CPU_PRESET}", f"[demo] preset {CPU_PRESET}: JAX sees only the CPU")


def probe(python: str = sys.executable, env: tuple[tuple[str, str], ...] = (), timeout: float = 300.0) -> Backend:
    """The backend JAX finds, asked in a process of its own that exits (and frees the chip) before the recipe
    starts. A probe that fails is read as a CPU (the CPU demo runs everywhere), and says why on stderr."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout, check=True,
                              env={**os.environ, **dict(env)})
        platform, kind, count, chips = json.loads(done.stdout.strip().splitlines()[-1])
        return Backend(str(platform).lower(), str(kind), int(count), int(chips), env)
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as error:
        lines = (getattr(error, "stderr", None) or str(error)).strip().splitlines()
        print(f"[demo] JAX could not say what it sees ({lines[-1] if lines else type(error).__name__}); "
              "running the CPU demo", file=sys.stderr)
        return Backend("cpu", "", 1)


def find_backend(ask=probe, prefix: str = sys.prefix) -> Backend:
    """JAX's backend as the environment has it; where that is a CPU but TPU chips are on the PCI bus and `make`
    put libtpu in the environment's side folder, asked again with TPU_LIBRARY_PATH pointing there."""
    backend = ask()
    side = os.path.join(prefix, SIDE_LIBTPU)
    if backend.platform == "cpu" and backend.tpu_chips and "TPU_LIBRARY_PATH" not in os.environ \
            and os.path.isfile(side):
        again = ask(env=(("TPU_LIBRARY_PATH", side),))
        if again.platform in ACCELERATORS:
            return again
    return backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnx_surgery.recipes.demo_choice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-command", action="store_true", help="print the recipe's command and stop")
    args = parser.parse_args(argv)
    choice = choose(find_backend())
    print(choice.why, flush=True)
    command = choice.command()
    if args.print_command:
        print(" ".join([*(f"{key}={shlex.quote(value)}" for key, value in choice.env), shlex.join(command)]))
        return 0
    os.environ.update(dict(choice.env))
    os.execv(command[0], command)  # the recipe in this process: its output, exit code and signals
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
