"""The serving wing: what SGLang captures, which flags it runs, how it is launched and talked to,
and the checkpoint it loads."""
