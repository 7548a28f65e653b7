"""Counted FLOPs of one logit-distillation step, from config.json sizes (peers_270m.md §4).

Only matmuls count, dense as every implementation here computes them: 2 FLOPs per matrix parameter per token
forward, 6 forward + backward; the (tied) LM head counts once as a (V, D) matrix; the embedding gather is free.
Attention scores and mixing count the full T x T block (QK^T + PV = 4 T N H per token per layer), as all three
peers compute it. Teacher: forward only. Student: forward + backward. Softmax, KL and the optimizer are not
counted (memory-bound), so achieved FLOP/s "includes" their time.

For the Gemma3-270M teacher, its 9-layer student and B x T = 2 x 128 this gives 477.98 GFLOP per step, the
figure of the peer study; at the CPU's 180 GFLOP/s fp32 matmul peak that is 96 tokens/s.
"""
from __future__ import annotations

import json
import os


def _config(folder_or_dict) -> dict:
    if isinstance(folder_or_dict, dict):
        return folder_or_dict
    with open(os.path.join(folder_or_dict, "config.json")) as f:
        return json.load(f)


def trunk_parameters(config) -> int:
    """Matrix parameters of the decoder layers (attention and MLP projections)."""
    c = _config(config)
    d, f, n = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    k = c.get("num_key_value_heads") or n
    h = c.get("head_dim") or d // n
    return c["num_hidden_layers"] * (2 * d * n * h + 2 * d * k * h + 3 * d * f)


def matrix_parameters(config) -> int:
    c = _config(config)
    return trunk_parameters(c) + c["vocab_size"] * c["hidden_size"]  # LM head (tied or not); the gather is free


def attention_flops_per_token(config, seq_len: int) -> int:
    c = _config(config)
    n = c["num_attention_heads"]
    h = c.get("head_dim") or c["hidden_size"] // n
    return c["num_hidden_layers"] * 4 * seq_len * n * h


def step_flops(teacher, student, batch: int, seq_len: int) -> float:
    tokens = batch * seq_len
    per_token = 2 * matrix_parameters(teacher) + attention_flops_per_token(teacher, seq_len)
    per_token += 6 * matrix_parameters(student) + 3 * attention_flops_per_token(student, seq_len)
    return float(tokens * per_token)
