"""Studies built on the planner and the trainer: scaling (time to train against GPU count) and
memorization (goldfish loss against standard loss)."""
