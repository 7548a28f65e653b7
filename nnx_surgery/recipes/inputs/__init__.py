"""What the recipes and the commands train on when the user names no teacher or data of their own: the corpus
settings and batches (corpus.py) and the tiny preset's self-trained teacher (tiny_teacher.py)."""
