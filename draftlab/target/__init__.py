"""The target LLM: found (a folder, a hub id, a GGUF file, a file inside an installed package), checked, pinned and loaded."""
