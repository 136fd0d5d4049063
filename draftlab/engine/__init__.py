"""The project's own speculative engine (EAGLE-3 and n-gram drafts verified by the target) and the reference server that serves it behind SGLang's HTTP API."""
