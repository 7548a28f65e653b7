"""The teacher-cache tests' workspace (tests/distill/inputs/test_distill_teacher_cache.py, tests/distill/loop/test_distill_cache_training.py):
a tiny Gemma 3 teacher folder with a Gemma-style tokenizer, and two standard-library files as data."""
from __future__ import annotations

import os
import shutil
import sysconfig

from hf_reference import make_hf_model, save_hf
from tiny_tokenizers import save_gemma_tokenizer


def teacher_workspace(base) -> dict:
    """{"base", "teacher" (folder), "data" (folder of .py files), "vocab" (the tokenizer's size)} under `base`."""
    teacher, data = str(base / "teacher"), base / "data"
    size = save_gemma_tokenizer(teacher)
    save_hf(make_hf_model("gemma3_text", seed=3, vocab_size=size, query_pre_attn_scalar=12, num_hidden_layers=2),
            teacher)
    data.mkdir()
    for name in ("textwrap.py", "bisect.py"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), data)
    return dict(base=base, teacher=teacher, data=str(data), vocab=size)
