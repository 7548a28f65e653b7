"""distill: recover a pruned student's quality from its teacher in one jitted, mesh-sharded train step.

    config = DistillConfig(stages=[Stage(steps=200, trainable=["*.self_attn.k_proj", "*.self_attn.v_proj"]),
                                   Stage(steps=2000, weights=LossWeights(kl=1.0, feature=0.1))],
                           plan=plan, mesh="fsdp=4,tp=2")
    result = run(teacher, student, TokenBatches.from_files("corpus/", "teacher_folder", batch_size=8, seq_len=1024),
                 config)

Evaluation (held-out sets, the suite, the shape search's ranking) is `nnx_surgery.evaluation`, above this
package. The models are used only through the small interface of `distill.interface.DistillModel` (logits from final
hidden states, plus requested intermediates), so the package does not depend on the surgery's models. Each loss is
one registered object (`distill.losses.term_registry`, `LossTerm`): `register_loss(term)` adds one.
"""
from .loop.run_config import (CheckpointConfig, DistillConfig, GuardConfig, LossWeights, OOMConfig, OptimizerConfig,
                              Ramp, Stage, TargetsConfig)
from .loop import schedules
from .loop.schedules import progressive, resolve_epochs, sft_then_distil
from .loop.trainer import DistillResult, DivergenceError, OutOfMemoryError, run
from .loop.lowering import CompileAhead, compile_ahead  # a run's first programs compiled in a thread beforehand
from .loop import fallbacks, oom, target_monitor as targets
from .mesh import MeshError, initialize_distributed, make_mesh, put_batch, shard_model
from .distributed import DistributedError, DistributedSettings  # multi-host: jax.distributed settings
from .interface import Correspondence, DistillModel, correspondence_from_plan
from .interface import Sampler
from .loop.on_policy import OnPolicyConfig
from .loop.freeze import expand_braces, pattern_matches, selected_paths, split_trainable, trainable_filter
from .losses.divergence import LogitLossSettings, fused_logit_loss, reference_logit_loss
from .labels import labels_and_weights
from .losses.representations import attention_transfer_loss, feature_loss, pool_features
from .losses.term_types import LossTerm, ModelSide, TermInputs, TermOption
from .losses.term_registry import register as register_loss
from .losses import term_registry as terms
from .loop.metrics import MetricsLogger, make_logger, plot_history, step_flops
from .inputs.batches import DataError, TokenBatches, check_vocabulary, load_tokenizer, stdlib_corpus
from .inputs.sources import far_prose, general_mix, general_prose
from .interruption import RunInterrupted
from .fingerprints import batch_digest, compare_sequences, sequence_digest, weights_digest
from .trimmed_vocab import TeacherInStudentVocabulary  # a trimmed student's teacher (DistillConfig.vocab_map)

__all__ = ["CheckpointConfig", "DistillConfig", "GuardConfig", "LossWeights", "OptimizerConfig", "Ramp", "Stage",
           "TargetsConfig", "OOMConfig", "schedules", "progressive", "resolve_epochs", "sft_then_distil",
           "DistillResult", "DivergenceError", "OutOfMemoryError", "run", "fallbacks", "oom", "targets", "MeshError", "initialize_distributed", "make_mesh", "put_batch",
           "shard_model", "Correspondence", "DistillModel", "correspondence_from_plan", "expand_braces",
           "pattern_matches", "selected_paths", "split_trainable", "trainable_filter", "LogitLossSettings",
           "fused_logit_loss", "labels_and_weights", "reference_logit_loss", "attention_transfer_loss",
           "feature_loss", "plot_history", "step_flops", "DataError", "TokenBatches", "check_vocabulary", "RunInterrupted",
           "load_tokenizer", "stdlib_corpus", "general_prose", "general_mix", "far_prose", "LossTerm", "ModelSide", "TermInputs", "TermOption", "register_loss", "terms", "pool_features", "MetricsLogger", "make_logger",
           "OnPolicyConfig", "Sampler", "DistributedError", "DistributedSettings"]
__all__ += ["TeacherInStudentVocabulary", "batch_digest", "CompileAhead", "compile_ahead",
            "compare_sequences", "sequence_digest", "weights_digest"]
