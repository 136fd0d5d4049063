"""Params profiles as DVC experiments (draftlab exp run) and dvc.yaml's stages without DVC (draftlab run-stages)."""
