"""The Tunix peer (google-tunix 0.1.7), run with the interpreter of `bench/.venv-tunix` (see bench/tunix_env.py).

    python bench/peers/tunix_peer.py load CKPT [--dtype bfloat16]
    python bench/peers/tunix_peer.py distill --teacher T --student S --batch 2 --seq 128 --warmup 3 --steps 8

Standalone on purpose: this venv has safetensors 0.7, so it must not import the project's `surgery` package.
Each command prints one JSON line.

* load: `tunix.models.gemma.params_safetensors.create_model_from_safe_tensors` (Gemma 2) or the gemma3 one,
  with a `ModelConfig` converted from the checkpoint's config.json (Tunix has no converter, tunix.md §2.4). Its
  Gemma 1 path is broken as shipped (tunix.md §3), so Gemma 1 checkpoints are refused.
* distill: `DistillationTrainer` + `LogitStrategy(temperature=1, alpha=1)`, i.e. pure forward KL at T=1, the same
  loss as the other peers; the 0-weighted CE and the teacher-CE metric that LogitStrategy always computes are part
  of its cost (peers_270m.md §1). The per-step time is the interval between the trainer's successive batch fetches
  (it dispatches asynchronously with 2 steps in flight), the steady-state throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (stdlib only)


def tunix_config(folder: str, param_dtype=None):
    """Tunix `ModelConfig` + model module for an HF Gemma 2 / Gemma 3 text checkpoint's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    kind = hf["model_type"]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    common_kwargs = dict(num_layers=hf["num_hidden_layers"], num_embed=hf["vocab_size"], embed_dim=hidden,
                         hidden_dim=hf["intermediate_size"], num_heads=heads,
                         head_dim=hf.get("head_dim") or hidden // heads,
                         num_kv_heads=hf.get("num_key_value_heads") or heads)
    qpas = hf.get("query_pre_attn_scalar")
    if qpas and int(qpas) != common_kwargs["head_dim"]:
        raise SystemExit(f"tunix scales queries by head_dim**-0.5; query_pre_attn_scalar={qpas} is not supported")
    if kind == "gemma2":
        from tunix.models.gemma import model as lib, params_safetensors as loader

        types = [lib.AttentionType.LOCAL_SLIDING if t == "sliding_attention" else lib.AttentionType.GLOBAL
                 for t in hf["layer_types"]]
        config = lib.ModelConfig(**common_kwargs, final_logit_softcap=hf.get("final_logit_softcapping"),
                                 use_post_attn_norm=True, use_post_ffw_norm=True, attention_types=tuple(types),
                                 attn_logits_soft_cap=hf.get("attn_logit_softcapping"),
                                 sliding_window_size=hf.get("sliding_window"))
        return config, lib, loader, hf
    if kind == "gemma3_text":
        from tunix.models.gemma3 import model as lib, params_safetensors as loader
        import jax.numpy as jnp

        rope = hf.get("rope_parameters") or {}
        local = (rope.get("sliding_attention") or {}).get("rope_theta", hf.get("rope_local_base_freq", 10_000))
        full = rope.get("full_attention") or {}
        config = lib.ModelConfig(**common_kwargs, sliding_window_size=hf.get("sliding_window"),
                                 local_base_frequency=int(local),
                                 global_base_frequency=int(full.get("rope_theta", hf.get("rope_theta", 1e6))),
                                 global_scale_factor=float(full.get("factor", 1.0)),
                                 param_dtype=param_dtype or jnp.float32)
        return config, lib, loader, hf
    raise SystemExit(f"tunix peer: model_type {kind!r} not measured (Gemma 1 loading is broken in tunix 0.1.7)")


def load_model(folder: str, dtype, prepared=None):
    config, lib, loader, hf = prepared or tunix_config(folder, param_dtype=dtype)
    model = loader.create_model_from_safe_tensors(folder, config, dtype=dtype)
    if hf["model_type"] == "gemma3_text":
        _fix_gemma3_layer_types(model, lib, config, hf["layer_types"])
    return model


def _fix_gemma3_layer_types(model, lib, config, layer_types) -> None:
    """Tunix forces the 5-local/1-global cycle; a pruned student's layer types are set per layer (tunix.md §3)."""
    for layer, kind in zip(model.layers, layer_types):
        sliding = kind == "sliding_attention"
        layer.attn.attn_type = lib.AttentionType.LOCAL_SLIDING if sliding else lib.AttentionType.GLOBAL
        layer.attn.rope_base_frequency = config.local_base_frequency if sliding else config.global_base_frequency
        layer.attn.rope_scale_factor = config.local_scale_factor if sliding else config.global_scale_factor


def cmd_load(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    prepared = tunix_config(args.checkpoint, param_dtype=dtype)  # imports the loader outside the timed part
    jax.devices()
    rss_before = common.current_rss_bytes()
    start = time.perf_counter()
    model = load_model(args.checkpoint, dtype, prepared)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"peer": "tunix", "load_s": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
            "rss_before_load_bytes": rss_before, "parameters": int(params)}


def cmd_distill(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tunix.distillation import distillation_trainer as dt
    from tunix.distillation.strategies import logit
    from tunix.sft import utils as sft_utils

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    teacher = load_model(args.teacher, dtype)
    student = load_model(args.student, dtype)
    rss_after_load = common.current_rss_bytes()
    vocab = teacher.config.num_embed

    def forward(model, input_tokens, input_mask):
        positions = sft_utils.build_positions_from_mask(input_mask)
        mask = sft_utils.make_causal_attn_mask(input_mask)
        logits, _ = model(input_tokens, positions, None, mask)
        return logits[:, :-1]

    def labels_fn(input_tokens, input_mask):
        return jax.nn.one_hot(input_tokens[:, 1:], vocab)

    strategy = logit.LogitStrategy(student_forward_fn=forward, teacher_forward_fn=forward, labels_fn=labels_fn,
                                   temperature=1.0, alpha=1.0)
    total = args.warmup + args.steps
    config = dt.TrainingConfig(eval_every_n_steps=10**9, max_steps=total, pbar_description=None)
    trainer = dt.DistillationTrainer(student, teacher, strategy, optax.adamw(args.lr, weight_decay=1e-4), config)
    fetch_times: list[float] = []

    def batches():
        rng = np.random.default_rng(args.seed)
        while True:
            tokens = rng.integers(0, vocab, (args.batch, args.seq)).astype(np.int32)
            fetch_times.append(time.perf_counter())
            yield dt.TrainingInput(input_tokens=jnp.asarray(tokens),
                                   input_mask=jnp.ones((args.batch, args.seq), jnp.bool_))

    start = time.perf_counter()
    trainer.train(batches())
    jax.block_until_ready(nnx.state(trainer.model))
    end = time.perf_counter()
    intervals = [b - a for a, b in zip(fetch_times, fetch_times[1:])][:total]
    measured = intervals[args.warmup:]
    losses = [float(x) for x in trainer.metrics_logger.get_metric_history(trainer.metrics_prefix, "loss", "train")]
    step = float(np.median(measured))
    return {"peer": "tunix", "median_step_s": step, "tokens_per_s": args.batch * args.seq / step,
            "step_times_s": [round(x, 4) for x in measured], "peak_rss_bytes": common.peak_rss_bytes(),
            "rss_after_load_bytes": rss_after_load, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "train_wall_s": end - start,
            "batch": args.batch, "seq": args.seq}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load")
    load.add_argument("checkpoint")
    load.add_argument("--dtype", default="bfloat16")
    distill = sub.add_parser("distill")
    distill.add_argument("--teacher", required=True)
    distill.add_argument("--student", required=True)
    for name, default in (("batch", 2), ("seq", 128), ("warmup", 3), ("steps", 8), ("seed", 0)):
        distill.add_argument(f"--{name}", type=int, default=default)
    distill.add_argument("--lr", type=float, default=1e-4)
    distill.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    record = cmd_load(args) if args.command == "load" else cmd_distill(args)
    import tunix  # noqa: F401

    record["versions"] = common.versions()
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()
