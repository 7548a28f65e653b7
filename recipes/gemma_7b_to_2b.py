"""The documented entry of the main recipe: compress a teacher into a student (plan, prune, distil, evaluate, save).

    python recipes/gemma_7b_to_2b.py --preset gemma3-270m --output runs/gemma3-270m   # the real Gemma 3 270M, offline
    python recipes/gemma_7b_to_2b.py --preset tiny --output runs/tiny                 # a tiny self-trained teacher
    python recipes/gemma_7b_to_2b.py --help                                           # every flag, its default, why

The same as `nnx-surgery compress ...` once the package is installed; the recipe itself (its phases, defaults and
the papers they follow) is `nnx_surgery/recipes/compress/pipeline.py`, its command (settings resolved once, then
--aot or the run) `nnx_surgery/recipes/compress_command.py`. This file only makes a checkout runnable without
installing it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nnx_surgery.recipes.compress_command import entry  # noqa: E402

if __name__ == "__main__":
    entry()
