"""`python -m nnx_surgery ...` is the `nnx-surgery` command (nnx_surgery/cli.py)."""
import sys

from nnx_surgery.cli import main

if __name__ == "__main__":
    sys.exit(main())
