"""The EAGLE-3 draft model and its training with training-time test."""
