"""The wiring check: proves that capture, export and serving agree, or names the fault."""
