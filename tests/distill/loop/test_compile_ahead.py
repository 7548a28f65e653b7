"""distill.compile_ahead: a run's first train step and evaluation compiled in a thread beforehand are the programs
the run then calls (it compiles neither), from a model that stands in for the trained one and is left unchanged;
a run of another shape compiles its own, and a failed compile is reported, not raised. On one device and on a
mesh."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from distill_fixtures import student_from, teacher_samples, tiny_teacher
from nnx_surgery import distill
from nnx_surgery.distill.loop.lowering import AheadProgram, CompileAhead
from recipe_env import result_on_host_devices



class Batches:
    def __init__(self, batches, length: int, rows: int = 4):
        self.batches, self.taken = [{"input_ids": b["input_ids"][:rows, :length]} for b in batches], 0

    def next_batch(self):
        self.taken += 1
        return self.batches[(self.taken - 1) % len(self.batches)]

    def eval_batches(self):
        return self.batches[:2]


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher()


def config(length: int, *, kl: float, rows: int = 4) -> distill.DistillConfig:
    """Programs of this file's own shapes (`length` tokens), so that no other test compiled them before."""
    return distill.DistillConfig(stages=[distill.Stage(steps=2, weights=distill.LossWeights(kl=kl, ce=1.0),
                                                       frozen=["embed_tokens"])],
                                 batch_size=rows, seq_len=length, eval_every=1, eval_batches=1)


def student(teacher, dtype):
    model = student_from(teacher)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param)))
    return model


def compiled_during(run) -> tuple[list[str], object]:
    """(the functions XLA compiled while `run()` ran, its result)."""
    compiled: list[str] = []

    def record(event: str, _seconds: float, **fields) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(str(fields.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        return compiled, run()
    finally:
        jax.monitoring.unregister_event_duration_listener(record)


@pytest.mark.parametrize("kl, dtype, length", [(1.0, jnp.float32, 11), (0.0, jnp.bfloat16, 13)],
                         ids=["kl-with-teacher-float32", "ce-alone-bfloat16"])
def test_the_run_calls_the_programs_compiled_ahead(teacher, kl, dtype, length):
    samples = teacher_samples(teacher, 3)
    settings, given = config(length, kl=kl), teacher if kl else None
    stand_in = student(teacher, dtype)
    before = (distill.weights_digest(stand_in), jax.tree.map(lambda x: x.dtype, nnx.state(stand_in)))
    data = Batches(samples, length)
    done = distill.compile_ahead(given, stand_in, data, settings).wait()
    assert done["error"] is None and set(done["compiled_s"]) == {"train step", "evaluation"}, done
    assert (distill.weights_digest(stand_in), jax.tree.map(lambda x: x.dtype, nnx.state(stand_in))) == before
    assert data.taken == 0  # its data was copied, not read

    names, result = compiled_during(lambda: distill.run(given, student(teacher, dtype), Batches(samples, length),
                                                        settings))
    assert "jit(step)" not in names and "jit(evaluate)" not in names, names
    assert result.history[0]["compile_reused"] is True
    assert len(result.evals) == 3  # steps 0, 1, 2: every evaluation ran on the program compiled ahead


def test_a_run_of_another_shape_compiles_its_own(teacher):
    samples = teacher_samples(teacher, 3)
    done = distill.compile_ahead(None, student(teacher, jnp.float32), Batches(samples, 9), config(9, kl=0.0)).wait()
    assert done["error"] is None
    names, result = compiled_during(lambda: distill.run(None, student(teacher, jnp.float32),
                                                        Batches(samples, 9, rows=2), config(9, kl=0.0, rows=2)))
    assert "jit(step)" in names and "jit(evaluate)" in names, names
    assert "compile_reused" not in result.history[0]


def test_a_compile_is_counted_after_another_library_cleared_every_listener(teacher):
    """Tunix's metrics logger clears every JAX monitoring listener of the process when it closes: the runner
    registers its counters again before it compiles, so a step it compiled is never called reused."""
    jax.monitoring.clear_event_listeners()
    samples = teacher_samples(teacher, 3)
    result = distill.run(None, student(teacher, jnp.float32), Batches(samples, 7), config(7, kl=0.0))
    assert "compile_reused" not in result.history[0] and result.history[0]["compile_s"] > 0


def test_a_failed_compile_is_reported_and_the_rest_left_to_the_run():
    def broken(x):
        raise ValueError("no such program\nsecond line")

    done = CompileAhead([AheadProgram("broken", jax.jit(broken), (jnp.zeros(2),), None)]).wait()
    assert done == {"compiled_s": {}, "error": "broken: ValueError: no such program"}


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax
    from distill_fixtures import FAST_COMPILE, KEPT_LAYERS, student_from, teacher_samples, tiny_teacher
    from nnx_surgery import distill

    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **fields: compiled.append(fields.get("fun_name"))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    class Data:
        def __init__(self):
            self.batches, self.taken = teacher_samples(teacher, 3), 0

        def next_batch(self):
            self.taken += 1
            return self.batches[(self.taken - 1) % 3]

        def eval_batches(self):
            return self.batches[:1]

    teacher = tiny_teacher()
    config = distill.DistillConfig(
        stages=[distill.Stage(steps=2, weights=distill.LossWeights(kl=1.0, ce=0.5, feature=0.1))],
        plan={{"kept_layers": list(KEPT_LAYERS)}}, feature_projection=True, batch_size=4, seq_len=16,
        eval_every=1, eval_batches=1, mesh="fsdp=2,tp=2", compiler_options=FAST_COMPILE, progress=False)
    done = distill.compile_ahead(teacher, student_from(teacher), Data(), config).wait()
    compiled.clear()
    result = distill.run(teacher, student_from(teacher), Data(), config)
    print("RESULT " + json.dumps({{"done": done, "compiled": compiled, "first": result.history[0]}}))
""")


@pytest.mark.slow  # a process of its own with 4 CPU devices
def test_on_a_mesh_the_run_calls_the_programs_compiled_ahead():
    """Sharded parameters, Adam state, batch and the traced hyper-parameters (made on the mesh) placed as the run
    places them, learned feature projections included."""
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = result_on_host_devices(MESH_SCRIPT.format(tests=tests), 4)
    assert out["done"]["error"] is None and set(out["done"]["compiled_s"]) == {"train step", "evaluation"}
    assert "jit(step)" not in out["compiled"] and "jit(evaluate)" not in out["compiled"], out["compiled"]
    assert out["first"]["compile_reused"] is True


EXIT_SCRIPT = textwrap.dedent("""
    import time, jax, jax.numpy as jnp
    from nnx_surgery.distill.loop.lowering import AheadProgram, CompileAhead

    def slow_to_compile(x):
        for i in range(120):
            x = jnp.tanh(x @ x) + jnp.sin(x * i)
        return x

    ahead = CompileAhead([AheadProgram("slow", jax.jit(slow_to_compile),
                                       (jax.ShapeDtypeStruct((32, 32), jnp.float32),), None)])
    time.sleep(0.2)
    print("compiling" if ahead._thread.is_alive() else "done", flush=True)
    raise SystemExit(3)
""")


def test_a_process_stopping_while_compiling_ahead_exits_with_its_own_status():
    """As --halt-after's exit 3 does while the control's step compiles (a daemon thread aborted the process)."""
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout.strip() == "compiling" and proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])


def test_a_reused_program_is_not_reported_as_a_cache_miss(tmp_path):
    """With a persistent cache folder set, a step that compiled says "hit" or "miss"; one the process already held
    says `compile_reused` and no cache verdict (it looked nothing up)."""
    from nnx_surgery.distill.loop import step_runner

    compiled = jax.jit(lambda x: x + 1).lower(jnp.zeros(3)).compile()
    counts, folder = step_runner._cache_counts, jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        reused = step_runner.compile_report(compiled, 0.01, counts["hits"], counts["compiles"])
        before = counts["compiles"]
        step_runner._count_compile("/jax/core/compile/backend_compile_duration", 2.0)  # as XLA's compile reports
        built = step_runner.compile_report(compiled, 2.0, counts["hits"], before)
    finally:
        jax.config.update("jax_compilation_cache_dir", folder)
    assert reused["compile_reused"] is True and "compile_cache" not in reused
    assert built["compile_cache"] == "miss" and "compile_reused" not in built
