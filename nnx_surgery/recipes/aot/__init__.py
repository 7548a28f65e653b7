"""`--aot TARGET`: the compress run's own programs compiled for a target with no weights (ahead-of-time sizing):
the targets (targets.py), the programs (programs.py), one compile measured (report.py), the search for settings
that fit (search.py), the released models' configs (released.py) and the run (sizing.py)."""
