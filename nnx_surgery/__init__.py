"""nnx-surgery: turn a large Gemma (or Llama-family) model into a smaller one that is still good, in Flax NNX.

    from nnx_surgery import surgery, distill

    teacher = surgery.load_pretrained("google/gemma-7b")                 # config.json decides everything
    plan = surgery.plan_student(teacher, surgery.StudentSpec.named("gemma-2b"), calibration=token_ids)
    student = surgery.apply_plan(teacher, plan)                           # or surgery.prune_checkpoint from disk
    distill.run(teacher, student, data, distill.DistillConfig(plan=plan))
    surgery.save_student(student, plan, "out/student", source="google/gemma-7b")

The folders are the stages: `surgery` (load, plan, prune) comes first; `distill` (losses, freeze masks, meshes,
the training loop, data) never imports it and sees a model through its small interface; `evaluation` (held-out
sets, the suite, lm-eval) and `export` (GGUF, the Hub) follow; `recipes` (compress, its --aot sizing, DPO) uses
them all (ARCHITECTURE.md). The subpackages are imported on first use, so
`import nnx_surgery` alone does not import jax.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["surgery", "distill", "evaluation", "export", "recipes", "__version__"]


def __getattr__(name: str):
    if name in ("surgery", "distill", "evaluation", "export", "recipes"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
