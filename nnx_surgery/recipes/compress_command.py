"""The compress recipe as a command (`nnx-surgery compress`, recipes/gemma_7b_to_2b.py): its settings resolved
once (compress/resolution.py), then exactly one of `--print-config`, `--aot TARGET` (aot/sizing.py: the run's
programs compiled for TARGET, nothing trained) or the run (compress/pipeline.py), whose devices are prepared
before JAX touches them (a multi-host run's jax.distributed)."""
from __future__ import annotations

import json
import sys

from nnx_surgery import refusals
from nnx_surgery.recipes.aot import sizing
from nnx_surgery.recipes.compress import checks, files, multi_host, pipeline, resolution
from nnx_surgery.recipes.compress.run_phases import Interrupted
from nnx_surgery.recipes.config.sections import RecipeConfig

PROG = "gemma_7b_to_2b.py"


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> RecipeConfig:
    """The run's configuration: defaults < preset < schedule < --config < flags < --set, checked; nothing read but
    the --config file. `--help` shows compress/pipeline.py's docstring and every flag."""
    return resolution.resolve(argv, description=pipeline.__doc__ or "", prog=prog)


def main(argv: list[str] | None = None, prog: str = PROG) -> dict:
    """Resolve the settings, then exactly one of: print them, size the run for --aot TARGET, or run it (its
    devices prepared first: a multi-host run's jax.distributed, then --mesh against the devices)."""
    config = parse_args(argv, prog)
    if config.run.print_config:  # touches no device: settings for another machine print as well
        print(json.dumps(files.saved_config(config), indent=2))
        return {}
    if config.aot.target:  # the run's programs compiled for the target; nothing trained, only the report written
        return sizing.report_sizes(config)
    multi_host.start_distributed(config.multi_host)  # before anything touches devices
    checks.check_devices(config)
    return pipeline.compress(config)


def entry(argv: list[str] | None = None, prog: str = PROG) -> None:
    """The recipe as a command (`prog` names it in --help): one-line errors, exit 3 when --halt-after stops it."""
    try:
        refusals.guarded(lambda args: main(args, prog), argv)
    except Interrupted as stop:
        print(stop.code if isinstance(stop.code, str) else "interrupted", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    entry()


__all__ = ["parse_args", "main", "entry"]
