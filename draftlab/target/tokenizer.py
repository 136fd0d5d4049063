"""A tokenizer saved so that every transformers release loads it the same way."""
from __future__ import annotations

import json
import os
from pathlib import Path


def save_tokenizer(tokenizer, dir: str | os.PathLike) -> None:
    """save_pretrained, with the chat template inside tokenizer_config.json (where transformers 4
    and 5 both look) and a tokenizer class name that both know."""
    tokenizer.save_pretrained(dir, save_jinja_files=False)
    path, jinja = Path(dir) / "tokenizer_config.json", Path(dir) / "chat_template.jinja"
    config = json.loads(path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    if jinja.exists():  # a transformers version that ignored save_jinja_files=False
        config["chat_template"] = jinja.read_text()
        jinja.unlink()
    path.write_text(json.dumps(config, indent=2) + "\n")
