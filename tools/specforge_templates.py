"""Chat templates that SpecForge 0.2.0 lacks, registered in its TEMPLATE_REGISTRY under names that
its run config's `data.chat_template` then takes.

SpecForge picks the template by name (`build_eagle3_dataset` looks `data.chat_template` up in
`specforge.data.template.TEMPLATE_REGISTRY`) and has no config field or plugin hook for a custom
one: the registry's own docstring says to call `TEMPLATE_REGISTRY.register` before training. Its
launcher starts fresh interpreters (`python -m specforge.cli` workers, torchrun, capture servers),
so the call must run in each of them: tools/specforge_data.py writes a copy of this file as
`site/sitecustomize.py`, which Python imports at every start when that folder is on PYTHONPATH
(in place of any other sitecustomize further down the path).
So this file imports nothing of this project, and does nothing where SpecForge is not installed.

What the entry is for: SpecForge's GeneralParser renders a conversation with the target tokenizer's
own chat template (`tokenizer.apply_chat_template`), not from these fields. The fields decide two
things only: the system message it puts first when the conversation has none (`system_prompt`),
and the assistant spans it learns, `assistant_header` up to and including the first
`end_of_turn_token` (parse.py, GeneralParser.set_assistant_pattern).
"""

# SmolLM2-Instruct speaks ChatML; with no system message its template puts this one first. The entry
# puts the same one first itself, so the rendering is the template's with or without it.
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEMPLATES = {
    "smollm2-chatml": {
        "assistant_header": "<|im_start|>assistant\n",
        "user_header": "<|im_start|>user\n",
        "system_prompt": SMOLLM2_SYSTEM_PROMPT,
        # The end-of-turn token alone, not "<|im_end|>\n" as SpecForge's ChatML entries (qwen, lfm)
        # have it: the learned span then stops at <|im_end|>, as ours does. The newline after it
        # is the template's, never something the target generates (serving stops at <|im_end|>).
        "end_of_turn_token": "<|im_end|>",
    },
}


def register() -> list[str]:
    """Add TEMPLATES to SpecForge's registry (replacing entries of the same name); the names added,
    none where SpecForge is not importable."""
    try:
        from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate
    except ImportError:  # a process of another program that shares the PYTHONPATH
        return []
    for name, fields in TEMPLATES.items():
        TEMPLATE_REGISTRY.register(name=name, template=ChatTemplate(**fields), override=True)
    return list(TEMPLATES)


register()
