"""`make demo` chooses its preset from what JAX sees (nnx_surgery/recipes/demo_choice.py): on a CPU exactly the
command the Makefile ran before, with a TPU or a GPU the accelerator preset into its own folder, one line saying
which and why; the backend is injected (CI has no accelerator), and the real probe is asked once here."""
from __future__ import annotations

import os
import sys

import pytest

from nnx_surgery.recipes import demo_choice
from nnx_surgery.recipes.demo_choice import Backend, choose

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the Makefile's `demo` command before the chooser (commit de625ec), which the CPU demo must keep
BEFORE = ["recipes/gemma_7b_to_2b.py", "--preset", "gemma3-270m", "--output", "runs/gemma3-270m", "--resume",
          "--eval-tasks", "nnx_stdlib_next_line,nnx_stdlib_complete", "--eval-tasks-limit", "20"]


def test_on_a_cpu_the_demo_is_the_command_it_always_was():
    choice = choose(Backend("cpu", "cpu", 1))
    assert choice.why == "[demo] preset gemma3-270m: JAX sees only the CPU"
    assert choice.command("python") == ["python", *BEFORE] and choice.env == ()


def test_with_a_tpu_or_a_gpu_the_accelerator_preset_runs_into_its_own_folder():
    tpu = choose(Backend("tpu", "TPU v5 lite", 1, tpu_chips=1))
    assert tpu.why == "[demo] preset gemma3-270m-tpu: JAX sees a TPU v5 lite (1 device)"
    assert tpu.command("python") == ["python", *BEFORE[:1], "--preset", "gemma3-270m-tpu", "--output",
                                     "runs/gemma3-270m-tpu", *BEFORE[5:]]
    gpu = choose(Backend("gpu", "NVIDIA H100 80GB HBM3", 8))
    assert gpu.why == "[demo] preset gemma3-270m-tpu: JAX sees a GPU: NVIDIA H100 80GB HBM3 (8 devices)"


def test_tpu_chips_with_a_cpu_only_jax_are_asked_again_with_the_side_folders_libtpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    side = tmp_path / "libtpu" / "libtpu"
    side.mkdir(parents=True)
    (side / "libtpu.so").write_bytes(b"")
    asked = []

    def ask(env=()):
        asked.append(dict(env))
        return Backend("tpu", "TPU v5 lite", 1, 1, env) if env else Backend("cpu", "cpu", 1, tpu_chips=1)

    backend = demo_choice.find_backend(ask, prefix=str(tmp_path))
    assert asked == [{}, {"TPU_LIBRARY_PATH": str(side / "libtpu.so")}]
    choice = choose(backend)
    assert choice.preset == "gemma3-270m-tpu" and dict(choice.env) == {"TPU_LIBRARY_PATH": str(side / "libtpu.so")}
    assert choice.why.endswith("(1 device; libtpu from the side folder)")
    asked.clear()  # no chips on the bus: one question, the CPU demo
    assert demo_choice.find_backend(lambda env=(): asked.append(env) or Backend("cpu", "cpu", 1), str(tmp_path)) \
        == Backend("cpu", "cpu", 1) and asked == [()]


def test_a_probe_that_fails_runs_the_cpu_demo_and_says_why(capsys):
    backend = demo_choice.probe(python=sys.executable + "-no-such-python")
    assert backend.platform == "cpu" and "running the CPU demo" in capsys.readouterr().err


def test_the_real_probe_sees_what_jax_sees():
    import jax

    backend = demo_choice.probe()
    assert (backend.platform, backend.count) == (jax.devices()[0].platform, len(jax.devices()))


def test_print_command_and_the_makefile(monkeypatch, capsys):
    monkeypatch.setattr(demo_choice, "find_backend", lambda: Backend("tpu", "TPU v5 lite", 1, 1))
    assert demo_choice.main(["--print-command"]) == 0
    line, command = capsys.readouterr().out.splitlines()
    assert line == "[demo] preset gemma3-270m-tpu: JAX sees a TPU v5 lite (1 device)"
    assert command.split()[1:6] == ["recipes/gemma_7b_to_2b.py", "--preset", "gemma3-270m-tpu", "--output",
                                    "runs/gemma3-270m-tpu"]
    with open(os.path.join(ROOT, "Makefile")) as handle:
        makefile = handle.read()
    recipe = makefile.split("\ndemo: $(STAMP)\n", 1)[1].split("\n\n", 1)[0]
    assert recipe.strip() == "$(PY) -m nnx_surgery.recipes.demo_choice"


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_chosen_preset_resolves(platform):
    from nnx_surgery.recipes.compress import resolution

    choice = choose(Backend(platform, "", 1))
    config = resolution.resolve(choice.command("python")[2:] + ["--print-config"])
    assert (config.run.preset, config.run.output) == (choice.preset, choice.output)
