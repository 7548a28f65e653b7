"""Surgery on a teacher sharded over an 8-device (fsdp=4, tp=2) CPU mesh: the calibration forward runs sharded,
and the student comes back sharded the same way, with the logits of the unsharded surgery; its MLP refit gives the
unsharded refit's weights, placed as they were."""
import json
import os
import subprocess
import sys
import textwrap

from recipe_env import with_host_devices

SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    from jax.sharding import AxisType, NamedSharding
    from flax import nnx
    from nnx_surgery.surgery import ModelConfig, create_model
    from nnx_surgery.surgery.pruning.in_memory import apply_plan
    from nnx_surgery.surgery.pruning.mlp_refit import refit_mlp
    from nnx_surgery.surgery.modeling.causal_lm import parameter_sharding
    from nnx_surgery.surgery.planning.student_planner import plan_student
    from nnx_surgery.surgery.plans.student_spec import StudentSpec

    config = ModelConfig.from_hf_dict({
        "model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
        "query_pre_attn_scalar": 8, "sliding_window": 4, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0})
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    teacher = create_model(config, seed=1, mesh=mesh)
    local = create_model(config, seed=1)
    calibration = np.random.default_rng(0).integers(0, 64, (8, 12))
    spec = StudentSpec(2, 16, 32, 2, 2)
    plan = plan_student(teacher, spec, calibration=calibration)
    same = plan_student(local, spec, calibration=calibration)  # scores differ in the last digits (reduction order)
    for field in ("kept_layers", "kept_hidden", "kept_mlp", "kv_groups", "kept_heads"):
        assert getattr(plan, field) == getattr(same, field), field
    np.testing.assert_allclose(plan.scores["hidden"], same.scores["hidden"], rtol=1e-4)
    student = apply_plan(teacher, plan)
    reference = apply_plan(local, plan)
    checked = 0
    for path, variable in nnx.to_flat_state(nnx.state(student, nnx.Param)):
        sharding = variable[...].sharding
        assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh, (path, sharding)
        assert sharding.spec == parameter_sharding(variable, mesh).spec, (path, sharding.spec)
        checked += sharding.spec != jax.sharding.PartitionSpec(*([None] * variable[...].ndim))
    ids = np.random.default_rng(1).integers(0, 64, (2, 7))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.block_until_ready(student(ids).logits))
    want = np.asarray(reference(ids).logits)
    # the MLP refit on the sharded student: the weights the unsharded refit gives, placed as before
    refit_mlp(student, teacher, plan, calibration, batch_size=3)
    refit_mlp(reference, local, plan, calibration, batch_size=3)
    refit_diff = max(float(np.abs(np.asarray(a.mlp.down_proj.weight[...]) -
                                  np.asarray(b.mlp.down_proj.weight[...])).max())
                     for a, b in zip(student.layers, reference.layers))
    placed = all(a.mlp.down_proj.weight[...].sharding.spec == parameter_sharding(a.mlp.down_proj.weight, mesh).spec
                 for a in student.layers)
    print(json.dumps({"max_diff": float(np.abs(got - want).max()), "sharded_params": int(checked),
                      "refit_diff": refit_diff, "refit_placed": placed}))
""")


def test_sharded_teacher_gives_sharded_student():
    env = {**os.environ, "XLA_FLAGS": with_host_devices(8), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_diff"] < 1e-5
    assert result["sharded_params"] > 10
    assert result["refit_diff"] < 1e-4 and result["refit_placed"]
