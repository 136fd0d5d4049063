"""The training data: prompt sets (built-in tasks, ShareGPT, a user's file) and the target's answers to them (synthesis)."""
