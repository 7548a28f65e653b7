"""Planning a student: importance scores (importance.py) and the planner (student_planner.py), which measures a
plan's compensation by carrying it out (pruning), so it sits above pruning; the plan itself is surgery/plans/."""
