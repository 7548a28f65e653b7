"""What a plan is: the student's spec (student_spec.py), the shapes a budget allows (search_space.py), the kept
vocabulary (vocab_selection.py), the Plan record (plan_record.py) and its report (plan_report.py). Below pruning,
which carries a plan out, and planning, which makes one."""
