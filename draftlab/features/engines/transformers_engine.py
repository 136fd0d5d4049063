"""extract.engine transformers: the target in this process on one device, captured by forward hooks
(draftlab.features.extract.capture, the project's one transformers capture path)."""
from __future__ import annotations

from draftlab.features.extract import capture
from draftlab.target.load import load_target


class TransformersEngine:
    name = "transformers"

    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.config = model  # target_info reads the loaded model, as the stage always has

    @classmethod
    def load(cls, target_params, device: str) -> "TransformersEngine":
        model, tok = load_target(target_params, device)
        return cls(model, tok)

    def capture(self, input_ids, attention_mask, physical: list[int]):
        return capture(self.model, input_ids, attention_mask, physical)

    def close(self) -> None:
        self.model = None
