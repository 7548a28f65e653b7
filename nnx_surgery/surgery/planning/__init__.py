"""Planning a student: the spec, the search space, importance scores, vocabulary selection, the
planner, the plan record and its report."""
