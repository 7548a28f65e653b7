"""Distil a pruned student, then align it with DPO in Tunix, offline (`nnx_surgery/recipes/distill_then_dpo.py`).

    python recipes/distill_then_dpo.py --output runs/dpo                     # the tiny self-trained teacher
    python recipes/distill_then_dpo.py --help

Needs the `tunix` extra (`pip install 'nnx-surgery[tunix]' && pip install --no-deps google-tunix==0.1.7`).
This file only makes a checkout runnable without installing the package.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nnx_surgery import refusals  # noqa: E402
from nnx_surgery.recipes.distill_then_dpo import main  # noqa: E402

if __name__ == "__main__":
    refusals.guarded(main)
