"""The training loop and its collaborators: `distill.run`, the run's configuration, the jitted
step and its runner, batches, freezing, schedules, the divergence guard, fallbacks, OOM
handling, interruption, checkpoints, metrics and monitoring targets."""
