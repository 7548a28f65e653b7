"""nnx-surgery: exact Gemma 1/2/3 and Llama/Mistral/Qwen2 in Flax NNX, and the surgery that turns a large model
into a smaller one. Each family is one module of nnx_surgery/surgery/families/: its tensor schema, config adapter,
divisibility rule and GGUF conversion.

    teacher = load_pretrained("google/gemma-7b")              # config.json decides everything
    plan = plan_student(teacher, StudentSpec.named("gemma-2b"), calibration=token_ids)
    student = apply_plan(teacher, plan)                        # or prune_checkpoint(src, plan, dst) from disk
    refit_mlp(student, teacher, plan, token_ids)               # narrowed MLPs refitted to the teacher's (optional)
    save_student(student, plan, "out/student", source="google/gemma-7b")

Writing a student out for others (GGUF, the Hub, a model card) is `nnx_surgery.export`.
"""
from .modeling.model_config import ConfigError, ModelConfig
from .modeling.causal_lm import CausalLM, ModelOutput, abstract_model, create_model
from .families import SUPPORTED_MODEL_TYPES
from .storage.safetensors_stream import CheckpointError
from .storage.hf_checkpoint import load_pretrained, resolve_dtype, save_pretrained, tensor_table
from nnx_surgery.surgery.plans.student_spec import NAMED_SHAPES, SpecError, StudentSpec
from nnx_surgery.surgery.plans.search_space import ShapeCandidate, candidate_specs, parameter_counts, uniform_spec
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError
from .planning.student_planner import TeacherScores, plan_student, score_teacher
from .pruning.in_memory import apply_plan, compensation_effect, logit_distance, save_student
from .pruning.on_disk import prune_checkpoint
from .pruning.mlp_refit import RefitReport, refit_mlp
from nnx_surgery.surgery.plans.plan_report import format_report, plot_report
from .storage.gguf_import import cached_import, import_gguf
from .modeling.generation import Generation, generate, make_sampler
from .modeling.tunix import from_tunix, to_tunix, tunix_sampler  # Tunix itself is imported only when they are called

__all__ = ["ConfigError", "CheckpointError", "ModelConfig", "CausalLM", "ModelOutput", "SUPPORTED_MODEL_TYPES",
           "abstract_model",
           "create_model", "load_pretrained", "save_pretrained", "resolve_dtype", "tensor_table", "NAMED_SHAPES",
           "SpecError", "StudentSpec", "ShapeCandidate", "candidate_specs", "parameter_counts", "uniform_spec",
           "Plan", "PlanError", "plan_student", "score_teacher", "TeacherScores", "apply_plan",
           "compensation_effect",
           "logit_distance", "save_student", "prune_checkpoint", "refit_mlp", "RefitReport", "format_report",
           "plot_report", "import_gguf", "cached_import", "Generation",
           "generate", "make_sampler", "to_tunix", "from_tunix", "tunix_sampler"]
