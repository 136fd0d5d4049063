"""Self prompts: user turns the target writes itself (the "Magpie" method), a prompt source that scales.

The target is given its chat template up to where a user's text starts, nothing more: for
SmolLM2, "<|im_start|>system\\n<its default system prompt><|im_end|>\\n<|im_start|>user\\n". Sampled
(self_prompts.temperature > 0), it writes a user turn and closes it with the token the template puts
after one (`<|im_end|>`). Each such turn becomes a prompt row, and the target answers it in the
synthesize stage as it answers every prompt: the draft learns the target's answers to the questions
the target finds likely, in any number.

A turn cut at self_prompts.max_new_tokens (never closed), empty, or written as an answer (it holds the
reasoning markup, <think> or </think>, that a reasoning target writes in its own turns) is left out and
counted. The last is what a target does that never learned to write a user's turn: the embedded tiny
target, trained on its answers alone, wrote nothing else: all 454 turns it closed of 480
(reports/self-prompts-embedded-target/). The prompts stage then treats the rows as it treats any
source's (draftlab.data.prompts): dedupe, the length filter, and the content-hash split. Only the
rows that hash into the train share are kept, so the held-out split (and the bench's prompts) stay the main source's.

Two engines write them, as synthesis answers (synth.backend):
  hf       in-process transformers: batches of the prefix, each batch's seed from self_prompts.seed
  sglang / openai   SGLang's native /generate (the stage's own servers, or the server at synth.base_url,
           which must speak SGLang's /generate: SGLang or the reference server), batches of
           self_prompts.batch_size prefixes, each row's sampling_seed from self_prompts.seed
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from draftlab.data.prompts import SELF_PROMPTS_FILE as FILE  # the stage's file, the prompts stage's input
from draftlab.data.synth import row_seed
from draftlab.errors import UserError

KEY_FILE = ".written.json"  # beside it: the settings it was written under, for reuse (stages/self_prompts.py)
MARK = "\u2063SELF-PROMPT\u2063"  # a text no template writes: where the user's content would go
SOURCE = "self"  # the rows' "source"
REASONING_MARKUP = ("<think>", "</think>")  # in a user turn: the target wrote its own kind of turn, an answer


@dataclass
class Written:
    """What the target wrote: the kept user turns, and how many were left out, by reason."""

    texts: list[str] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=lambda: {"cut": 0, "empty": 0, "as_answer": 0})
    completion_tokens: int = 0

    def add(self, text: str, closed: bool, tokens: int) -> None:
        self.completion_tokens += tokens
        if not closed:
            self.left_out["cut"] += 1
        elif not (text := text.strip()):
            self.left_out["empty"] += 1
        elif any(mark in text for mark in REASONING_MARKUP):
            self.left_out["as_answer"] += 1
        else:
            self.texts.append(text)


def user_prefix(tok) -> tuple[list[int], list[int]]:
    """(token ids of the chat template up to a user turn's text, the ids that close a user turn:
    the first token the template puts after the text, and the tokenizer's end of sequence)."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    except Exception as e:  # a tokenizer without a template, or a template that refuses a lone user turn
        raise UserError(f"self_prompts: the target's chat template cannot render a user turn ({type(e).__name__}: {e}); "
                        "set self_prompts.count: 0") from None
    if text.count(MARK) != 1:
        raise UserError("self_prompts: the target's chat template does not put a user turn's text in its output as written; "
                        "set self_prompts.count: 0")
    before, after = text.split(MARK)
    prefix = tok(before, add_special_tokens=False)["input_ids"]
    closing = tok(after, add_special_tokens=False)["input_ids"][:1]
    stop = sorted({*closing, *([tok.eos_token_id] if tok.eos_token_id is not None else [])})
    if not prefix or not stop:
        raise UserError("self_prompts: the target's chat template has no text before or after a user turn to write one from; "
                        "set self_prompts.count: 0")
    return prefix, stop


def batches(count: int, batch_size: int) -> list[range]:
    """Row indices 0..count-1 in batches of batch_size: a row's index is its seed's key, whatever the batching."""
    return [range(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def write_hf(model, tok, params, device: str, progress: Callable[[int], None] = lambda n: None) -> Written:
    """`params.count` user turns from the in-process target (self_prompts section), batch by batch."""
    import torch

    prefix, stop = user_prefix(tok)
    out = Written()
    for rows in batches(params.count, params.batch_size):
        input_ids = torch.tensor([prefix] * len(rows), device=device)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(row_seed(params.seed, f"self:{rows.start}"))
            gen = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=params.max_new_tokens, do_sample=True, temperature=params.temperature,
                                 top_p=params.top_p, top_k=0, repetition_penalty=1.0,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0],
                                 eos_token_id=stop)
        for seq in gen[:, len(prefix):].tolist():
            end = next((k for k, t in enumerate(seq) if t in stop), None)
            body = seq[:end] if end is not None else seq
            out.add(tok.decode(body, skip_special_tokens=True), end is not None, len(body) + (end is not None))
        progress(len(rows))
    return out


def write_http(base_urls: list[str], tok, params, timeout_s: float,
               progress: Callable[[int], None] = lambda n: None) -> Written:
    """`params.count` user turns from SGLang servers (their URLs without /v1), one batch of
    self_prompts.batch_size rows per /generate request (SGLang's native API: token ids in, each row
    with its own sampling params), two requests in flight per server."""
    import httpx

    prefix, stop = user_prefix(tok)
    work = batches(params.count, params.batch_size)
    clients = [httpx.Client(base_url=url, timeout=timeout_s, trust_env=False) for url in base_urls]

    def one(i: int) -> list[dict]:
        rows, client = work[i], clients[i % len(clients)]
        body = {"input_ids": [prefix] * len(rows),
                "sampling_params": [{"temperature": params.temperature, "top_p": params.top_p,
                                     "max_new_tokens": params.max_new_tokens, "stop_token_ids": stop,
                                     "sampling_seed": row_seed(params.seed, f"self:{r}")} for r in rows]}
        try:
            r = client.post("/generate", json=body)
        except httpx.HTTPError as e:
            raise UserError(f"self_prompts: {client.base_url}/generate: {type(e).__name__}: {e}") from None
        out = r.json() if r.status_code == 200 else None
        if not (isinstance(out, list) and len(out) == len(rows) and all(isinstance(o, dict) and "text" in o for o in out)):
            raise UserError(f"self_prompts: {client.base_url}/generate answered HTTP {r.status_code}: {r.text[:300]}; "
                            "self prompts need SGLang's native /generate (an SGLang server, or synth.backend hf)")
        return out

    got = Written()
    try:
        with ThreadPoolExecutor(2 * len(clients)) as pool:
            for answers in pool.map(one, range(len(work))):  # in order: the rows do not depend on the timing
                for a in answers:
                    meta = a.get("meta_info") or {}
                    closed = (meta.get("finish_reason") or {}).get("type") == "stop"
                    got.add(a["text"], closed, int(meta.get("completion_tokens") or 0))
                progress(len(answers))
    finally:
        for client in clients:
            client.close()
    return got


def rows(texts: list[str]) -> list[dict]:
    """The prompt rows of the kept turns, in the order written ({"messages": [...], "source": "self"})."""
    return [{"messages": [{"role": "user", "content": t}], "source": SOURCE} for t in texts]
