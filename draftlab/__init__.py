"""draftlab: train, export and benchmark EAGLE-3 draft models for SGLang, reproducibly."""

__version__ = "0.1.0"
