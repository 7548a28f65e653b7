"""python -m nnx_surgery.evaluation.lm_eval_tasks FOLDER: write the offline lm-eval tasks into FOLDER (see the package)."""
import sys

from nnx_surgery.evaluation.lm_eval_tasks import TAG, write_tasks

if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
    print("usage: python -m nnx_surgery.evaluation.lm_eval_tasks FOLDER   (writes the task YAML files and their data)",
          file=sys.stderr)
    sys.exit(2)
folder = write_tasks(sys.argv[1])
print(f"{folder}: lm-eval tasks tagged {TAG}; run with --include_path {folder} --tasks {TAG}")
