"""The EAGLE-3 draft model and its training with training-time test."""

# Where stage train keeps its resumable checkpoint (last.pt) while it runs; deleted when the stage
# completes. A GPU node packs it on request (draftlab.experiments.grid.RESUME) for the next node.
RESUME_DIR = "models/.train-resume"
