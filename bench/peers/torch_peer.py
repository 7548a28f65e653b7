"""The PyTorch peer: transformers `from_pretrained` and a plain PyTorch logit-KD loop on the transformers models.

    python bench/peers/torch_peer.py load CKPT [--dtype bfloat16]
    python bench/peers/torch_peer.py distill --teacher T --student S --batch 2 --seq 128 --warmup 3 --steps 8

Each command prints one JSON line. The distillation step is the one of peers_270m.md §1-§2: teacher in eval mode
under `no_grad`, student in train mode, forward KL(teacher || student) at T=1 over positions 0..T-2 summed over
the vocabulary and averaged over B*(T-1) tokens, `torch.optim.AdamW(lr, weight_decay=1e-4)`, synchronous steps
(`loss.item()`), `torch.set_num_threads(os.cpu_count())`, attention as transformers resolves it (sdpa).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

DTYPES = ("bfloat16", "float32")


def cmd_load(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    rss_before = common.current_rss_bytes()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype)
    returned = time.perf_counter() - start
    # transformers may leave parameters backed by the file's mmap, faulted in on first use; read one element per
    # 4 KiB page so that "loaded" means resident for every peer.
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].sum()
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return {"peer": "torch", "load_s": seconds, "from_pretrained_returned_s": returned,
            "peak_rss_bytes": common.peak_rss_bytes(),
            "rss_before_load_bytes": rss_before, "parameters": int(params)}


def cmd_distill(args) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype).to(device).eval()
    teacher.requires_grad_(False)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=dtype).to(device).train()
    rss_after_load = common.current_rss_bytes()
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=1e-4)
    vocab = teacher.config.vocab_size
    rng = np.random.default_rng(args.seed)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        ids = torch.from_numpy(rng.integers(0, vocab, (args.batch, args.seq))).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits[:, :-1].float()
        s_logits = student(input_ids=ids, use_cache=False).logits[:, :-1].float()
        t_logp = F.log_softmax(t_logits, dim=-1)
        s_logp = F.log_softmax(s_logits, dim=-1)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="sum") / (args.batch * (args.seq - 1))
        kl.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(kl.item())
        times.append(time.perf_counter() - start)
        del t_logits, s_logits, t_logp, s_logp, kl
    measured = times[args.warmup:]
    step = float(np.median(measured))
    record = {"peer": "torch", "median_step_s": step, "tokens_per_s": args.batch * args.seq / step,
              "step_times_s": [round(x, 4) for x in measured], "peak_rss_bytes": common.peak_rss_bytes(),
              "rss_after_load_bytes": rss_after_load, "loss_first": losses[0], "loss_last": losses[-1],
              "batch": args.batch, "seq": args.seq, "attn_implementation": student.config._attn_implementation}
    if device == "cuda":
        record["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load")
    load.add_argument("checkpoint")
    load.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    distill = sub.add_parser("distill")
    distill.add_argument("--teacher", required=True)
    distill.add_argument("--student", required=True)
    for name, default in (("batch", 2), ("seq", 128), ("warmup", 3), ("steps", 8), ("seed", 0)):
        distill.add_argument(f"--{name}", type=int, default=default)
    distill.add_argument("--lr", type=float, default=1e-4)
    distill.add_argument("--dtype", default="float32", choices=DTYPES)
    distill.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    record = cmd_load(args) if args.command == "load" else cmd_distill(args)
    record["versions"] = common.versions()
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()
