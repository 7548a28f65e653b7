"""The compress recipe: load, plan, prune, distil, evaluate, export (pipeline.py), its settings derived once
(run_settings.py) and its phases (run_phases.py)."""
