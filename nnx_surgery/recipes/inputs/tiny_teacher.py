"""The tiny preset's teacher and data, made offline: a small Gemma with Gemma 7B's architecture and shape ratios,
trained here on the Python standard library's source with byte-level tokens, cached after the first run.

Gemma 7B is a Gemma 1 model: 28 layers, hidden 3072, MLP 8x hidden, 16 query heads and 16 KV heads (multi-head
attention), head_dim independent of hidden/heads. The tiny teacher keeps the depth, width and MLP ratios at 14
layers and hidden 48, so `StudentSpec.scaled_like` gives it a Gemma-2B-shaped student: 9 layers, hidden 32, MLP
256, 2 query heads and 1 KV head (multi-query), as 7B -> 2B.

Multi-host (`jax.distributed`): process 0 trains the teacher (on its own devices) and writes it to the cache (shared
storage); the other processes wait for it at a barrier, then read it.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import jax

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.refusals import RecipeError
from nnx_surgery.distill.inputs.batches import stdlib_corpus
from nnx_surgery.distill.inputs.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_byte_tokenizer
from nnx_surgery.surgery.storage.hf_checkpoint import model_tensors, write_hf_folder
from nnx_surgery.surgery.storage.safetensors_stream import write_json

TEACHER_CONFIG = {
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "vocab_size": VOCAB_SIZE, "hidden_size": 48,
    "intermediate_size": 384, "num_hidden_layers": 14, "num_attention_heads": 4, "num_key_value_heads": 4,
    "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
    "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "pad_token_id": PAD_ID,
    "eos_token_id": EOS_ID, "bos_token_id": BOS_ID,
}
TEACHER_LEARNING_RATE = 3e-3


@dataclasses.dataclass(frozen=True)
class TinyTeacherSettings:
    """What decides the tiny teacher (its cache key) and where it is cached: the corpus (--corpus-bytes of the
    standard library's source, --seed), the rows it trains on (--batch-size x --seq-len), --teacher-steps and
    --cache-dir; in a dry run it is not trained (its config alone)."""

    corpus_bytes: int
    seed: int
    batch_size: int
    seq_len: int
    steps: int
    cache_dir: str
    dry_run: bool = False

    @classmethod
    def of(cls, config: RecipeConfig) -> "TinyTeacherSettings":
        return cls(config.data.corpus_bytes, config.run.seed, config.data.batch_size, config.data.seq_len,
                   config.teacher.steps, config.run.cache_dir or "", config.run.dry_run)


def corpus_files(corpus_bytes: int, seed: int) -> list[str]:
    files = stdlib_corpus(max_bytes=corpus_bytes, seed=seed)
    if not files:
        raise distill.DataError("the Python standard library's source was not found; pass --data with text files.")
    return files


def batches(settings: TinyTeacherSettings, files: list[str], tokenizer_folder: str) -> distill.TokenBatches:
    """Packed byte-token batches of the corpus with a held-out split (5% of the files, fixed by the seed)."""
    return distill.TokenBatches.from_files(files, tokenizer_folder, batch_size=settings.batch_size,
                                           seq_len=settings.seq_len, seed=settings.seed,
                                           eval_batch_size=settings.batch_size)


def prepare_for(config: RecipeConfig) -> tuple[str, list[str]]:
    """`prepare` with the run's settings."""
    return prepare(TinyTeacherSettings.of(config))


def prepare(args: TinyTeacherSettings) -> tuple[str, list[str]]:
    """Return (teacher folder, corpus files), training and caching the teacher when it is not cached yet."""
    files = corpus_files(args.corpus_bytes, args.seed)
    key = json.dumps({"config": TEACHER_CONFIG, "steps": args.steps, "batch": args.batch_size,
                      "seq": args.seq_len, "seed": args.seed, "lr": TEACHER_LEARNING_RATE,
                      "files": [os.path.basename(f) for f in files]}, sort_keys=True)
    folder = os.path.join(args.cache_dir, "tiny-teacher-" + hashlib.sha256(key.encode()).hexdigest()[:12])
    cached = os.path.join(folder, "training.json")
    if os.path.exists(cached) and jax.process_count() == 1:
        print(f"[teacher] cached: {folder}")
        return folder, files
    if args.dry_run and not os.path.exists(cached):  # no training in a dry run: the config alone
        return dry_run_teacher(), files
    # multi-host: all meet first (JAX's CPU collectives give up on a peer that is 30 s late to their very first
    # meeting, and process 0 may train for minutes), then process 0 decides and trains while the others wait
    wait_for_process_0(f"tiny teacher start {folder}")
    if jax.process_index() == 0:
        if os.path.exists(cached):
            print(f"[teacher] cached: {folder}")
        else:
            train_teacher(args, files, folder)
    wait_for_process_0(f"tiny teacher {folder}")
    if not os.path.exists(cached):
        raise RecipeError(f"process 0 trained the tiny teacher into {folder}, but this process does not see it "
                              "there: --cache-dir must be shared storage on a multi-host run.")
    return folder, files


def dry_run_teacher() -> str:
    """The tiny teacher's config alone, for a dry run, in a temporary folder of this process removed when it
    exits: a dry run writes nothing, --cache-dir included."""
    folder = tempfile.mkdtemp(prefix="nnx-surgery-dry-run-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    write_json(os.path.join(folder, "config.json"), TEACHER_CONFIG)
    return folder


def wait_for_process_0(name: str) -> None:
    """Multi-host: a barrier until process 0 has done what it alone does (e.g. written a shared folder)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def train_teacher(args: TinyTeacherSettings, files: list[str], folder: str) -> None:
    """Train the tiny teacher on this process's devices alone and write it to `folder` with its tokenizer."""
    print(f"[teacher] training a tiny Gemma-7B-shaped teacher for {args.steps} steps "
          f"({len(files)} stdlib files); cached in {folder}")
    config = surgery.ModelConfig.from_hf_dict(TEACHER_CONFIG)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_folder = os.path.join(scratch, "tokenizer")
        save_byte_tokenizer(tokenizer_folder)
        write_json(os.path.join(tokenizer_folder, "generation_config.json"),
                   {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
        data = batches(args, files, tokenizer_folder)
        model = surgery.create_model(config, seed=args.seed)
        stage = distill.Stage(steps=args.steps, name="teacher", learning_rate=TEACHER_LEARNING_RATE,
                              warmup_steps=max(1, args.steps // 20),
                              weights=distill.LossWeights(kl=0.0, ce=1.0))
        result = distill.run(None, model, data, distill.DistillConfig(
            stages=(stage,), batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, plots=False,
            eval_every=max(1, args.steps // 2), eval_batches=4))
        record = {"steps": args.steps, "tokens": args.steps * args.batch_size * args.seq_len,
                  "heldout": result.evals[-1] if result.evals else None, "corpus_files": len(files)}
        os.makedirs(args.cache_dir, exist_ok=True)
        # save_pretrained's own writer: the model is on this process alone (save_pretrained on multi-host would
        # wait for the others to take part in its gathers)
        trained: Any = result.student  # the CausalLM it was given
        write_hf_folder(folder, trained.config, model_tensors(trained), source=tokenizer_folder,
                        extra_files={"training.json": record}, overwrite=True)


__all__ = ["TinyTeacherSettings", "prepare", "prepare_for", "batches", "corpus_files", "train_teacher", "wait_for_process_0", "TEACHER_CONFIG"]
