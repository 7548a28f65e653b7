"""A multi-host run's start: `jax.distributed` initialised from the multi-host section of the configuration, before
anything touches a device (compress's `main` calls it right after the settings are resolved)."""
from __future__ import annotations

import os
import sys

from nnx_surgery.distill.distributed import DistributedSettings, failure_note, initialize_distributed, is_main_process
from nnx_surgery.recipes.config.sections import MultiHostSection


def distributed_settings(section: MultiHostSection) -> DistributedSettings:
    """jax.distributed's settings from --distributed / --coordinator / --num-processes / --process-id /
    --heartbeat-timeout (a DistributedError when they do not make a cluster)."""
    options = {"heartbeat_timeout_s": section.heartbeat_timeout} if section.heartbeat_timeout is not None else {}
    return DistributedSettings(coordinator=section.coordinator, num_processes=section.num_processes,
                               process_id=section.process_id, auto=section.distributed == "auto", **options)


def start_distributed(section: MultiHostSection) -> bool:
    """Start `jax.distributed` when the settings ask for it. Every process says who it is on stderr; processes
    other than 0 print nothing on stdout from here on."""
    settings = distributed_settings(section)
    if not initialize_distributed(settings):
        return False
    print(failure_note(settings), file=sys.stderr, flush=True)
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")  # process 0 prints the run's progress and results
    return True


__all__ = ["distributed_settings", "start_distributed"]
