"""Hidden-state extraction: run the target over prompt + answer and keep the capture layers.

Physical index convention (DESIGN.md section 4): index i is transformers'
`output_hidden_states[i]`: 0 = embedding output, i = output of decoder layer i-1, L = the final
hidden state AFTER the final norm. Capture uses forward hooks on the chosen modules only, so
memory holds k + 1 layers of activations, never all L + 1.

Loss mask: the tokens of each assistant turn the target generated (reasoning included) and the
EOS that closes each one the target ended itself (not after an answer cut at synth.max_new_tokens);
nothing of the user turns or the template's role headers.
"""
from __future__ import annotations

import torch

from draftlab.errors import UserError
from draftlab.target.attention import attention_kernels


def decoder_layers(model):
    """The list of decoder blocks and the final norm of a transformers causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base, base.layers, base.norm


class AuxCapture:
    """Forward hooks keeping the model's hidden states at `physical` indices of its latest forward.

    The one capture path of the project: extraction, the speculative engine, the reference
    server and the live parity check all read hidden states through it. take() concatenates
    them in ascending physical order, as SGLang feeds them to the draft.
    """

    def __init__(self, model, physical: list[int]):
        self.model, self.physical = model, sorted(physical)
        self.got: dict[int, torch.Tensor] = {}
        self.hooks = []

    def __enter__(self):
        base, layers, norm = decoder_layers(self.model)
        L = len(layers)
        for i in self.physical:
            if not 0 <= i <= L:
                raise UserError(f"capture: physical index {i} out of range 0..{L}")
            module = base.embed_tokens if i == 0 else (layers[i - 1] if i < L else norm)
            self.hooks.append(module.register_forward_hook(self._keep(i)))
        return self

    def _keep(self, i):
        def hook(_module, _inputs, output):
            self.got[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def take(self) -> torch.Tensor:
        """[B, T, k * H] of the latest forward."""
        return torch.cat([self.got[i] for i in self.physical], dim=-1)


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, physical: list[int]):
    """Run `model` once; return ({physical index: [B, T, H]}, final hidden [B, T, H]).

    attention_mask: 1 on real tokens; None where every row's padding comes after its real tokens,
    as the stages pad. A causal target needs no mask then: no real token attends to the padding
    after it, so their states are the same, and transformers takes its mask-free causal attention
    instead of building a [B, 1, T, T] mask and attending through it. The padding's own states
    differ, and every caller drops them. (transformers still reads one flag on the host per
    forward: its check of the position ids for packed sequences.)"""
    base, layers, _ = decoder_layers(model)
    L = len(layers)
    with AuxCapture(model, sorted(set(physical) | {L})) as cap, attention_kernels(input_ids.device):
        # attention_kernels: every batch has its own padded length, and cuDNN would plan for each one.
        # The base model (no lm_head): logits over the vocab would cost B*T*V memory for nothing.
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return {i: cap.got[i] for i in physical}, cap.got[L]


def render(tok, messages: list[dict], turns: int = 1, finish_reasons: list[str] | None = None
           ) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and the loss mask of its last `turns` assistant turns
    (the ones the target generated: synthesis records how many, 1 for a single answer).

    finish_reasons: how each of those turns ended, in order (the row's, draftlab.data.answers);
    None = every one ended by the target ("stop").

    The conversation is rendered by the target's own chat template, exactly as serving renders
    it, then tokenized without adding special tokens (the template carries them). Each answer's
    content is learned, and the end-of-turn token right after it when the target ended the answer
    itself; user turns, earlier answers the target did not write, and the template's role markers
    are not.
    """
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not 1 <= turns <= len(answers):
        raise ValueError(f"turns {turns}: the conversation has {len(answers)} assistant turns")
    finish_reasons = ["stop"] * turns if finish_reasons is None else list(finish_reasons)
    if len(finish_reasons) != turns:
        raise ValueError(f"{len(finish_reasons)} finish reasons for {turns} assistant turns")
    full = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    starts = torch.tensor([s for s, _ in offsets], dtype=torch.long)
    ends = torch.tensor([e for _, e in offsets], dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids(tok.eos_token)) if t is not None}
    first = len(answers) - turns
    for n, (i, reason) in enumerate(zip(answers[first:], finish_reasons), start=first + 1):
        which = "the assistant turn" if len(answers) == 1 else f"assistant turn {n} of {len(answers)}"
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise UserError(f"the chat template renders the conversation before {which} differently with and without "
                            "what follows (a template that drops earlier turns' reasoning, say); cannot locate that turn")
        content = messages[i]["content"]
        start = len(prompt)
        at = full.find(content, start)
        if at < 0:
            raise UserError(f"the chat template does not render the content of {which} verbatim; cannot build the loss mask")
        end = at + len(content)
        mask |= (starts >= start) & (ends <= end) & (ends > starts)
        # The end-of-turn token right after an answer the target ended is its own: the draft must learn
        # to propose it too. After a cut answer the template put it there, where the target would have
        # gone on: learning it would teach the draft to end turns early.
        after = torch.nonzero(starts >= end)
        if reason == "stop" and len(after) and ids[int(after[0])] in eos:
            mask[int(after[0])] = True
    return ids, mask.tolist()


# --- the extraction run: plan shards, skip the ones already written, stream the rest ----------


def layer_key(physical_index: int) -> str:
    """Tensor name of one captured layer in an extraction shard."""
    return f"hidden.{physical_index}"


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Row indices per shard: rows sorted by length (ties by index), cut every ~shard_tokens.

    Sorting keeps batches free of padding waste; the plan depends only on the data, so an
    interrupted run re-plans identically and resumes at the first missing shard.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards, cur, tokens = [], [], 0
    for i in order:
        cur.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(cur)
            cur, tokens = [], 0
    if cur:
        shards.append(cur)
    return shards


class HostCopier:
    """Captured states to host memory, overlapped with the next batch's forward on a GPU.

    On an H200 the pageable copy of one batch's states (16k tokens of an 8B target) took 0.35 s
    against 0.45 s for the forward itself (reports/perf/): copied serially, extraction would run
    at about 56% of its forward rate. On CUDA, start() queues the copy into pinned buffers on a
    side stream and returns at once; wait() blocks only when the host needs the rows (measured:
    0.90-0.94x of the forward rate). On a CPU it is a plain cast.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def start(self, tensors: list[torch.Tensor], dtype) -> tuple[list[torch.Tensor], object]:
        if not self.cuda:
            return [x.to(dtype) for x in tensors], None
        self.stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # the forward that made them
        host = []
        with torch.cuda.stream(self.stream):
            for x in tensors:
                x.record_stream(self.stream)  # the forward's memory stays ours until the copy is done
                y = x.to(dtype)
                h = torch.empty(y.shape, dtype=dtype, pin_memory=True)
                h.copy_(y, non_blocking=True)
                host.append(h)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    @staticmethod
    def wait(handle) -> list[torch.Tensor]:
        host, done = handle
        if done is not None:
            done.synchronize()
        return host


def extract_shard(model, rows: list[tuple[list[int], list[bool]]], physical: list[int], batch_size: int, dtype, device) -> dict:
    """Hidden states for `rows` (ids, mask), packed without padding: one tensor per name.
    `model`: a transformers target, or a capture engine (draftlab.features.engines).

    Batch b's states travel to the host while batch b+1's forward runs (HostCopier); each row
    is then copied once, into its place in the shard's preallocated tensors.
    """
    pad = 0
    names = [layer_key(i) for i in physical] + ["final_hidden"]
    offsets = [0]
    for ids, _ in rows:
        offsets.append(offsets[-1] + len(ids))
    out: dict[str, torch.Tensor] = {}
    copier = HostCopier(device)

    def unpack(first: int, handle) -> None:
        host = copier.wait(handle)
        if not out:
            out.update({name: torch.empty(offsets[-1], h.shape[-1], dtype=dtype) for name, h in zip(names, host)})
        for j in range(host[0].shape[0]):
            a, b = offsets[first + j], offsets[first + j + 1]
            for name, h in zip(names, host):
                out[name][a:b] = h[j, : b - a]

    pending = None
    for b in range(0, len(rows), batch_size):
        batch = rows[b : b + batch_size]
        T = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        att = torch.zeros((len(batch), T), dtype=torch.long)
        for j, (r, _) in enumerate(batch):  # right padding: positions of real tokens stay 0..n-1
            ids[j, : len(r)] = torch.tensor(r)
            att[j, : len(r)] = 1
        if isinstance(model, torch.nn.Module):
            aux, final = capture(model, ids.to(device), None, physical)  # padded at the end: no mask needed (capture)
        else:  # a capture engine (draftlab.features.engines): the same contract
            aux, final = model.capture(ids.to(device), att.to(device), physical)
        handle = (b, copier.start([aux[i] for i in physical] + [final], dtype))
        del aux, final
        if pending is not None:
            unpack(*pending)  # the previous batch, copied while this one's forward ran
        pending = handle
    if pending is not None:
        unpack(*pending)
    return {**out, **tokens_record(rows)}


# --- train.features online: a tokens-only record of every row, no hidden states ---------------

TOKENS_FILE = "tokens.safetensors"  # per split, beside the (sample) shards


def tokens_record(rows: list[tuple[list[int], list[bool]]]) -> dict[str, torch.Tensor]:
    """The packed token arrays of a shard (input_ids, loss_mask, seq_offsets) without the states:
    a few bytes per token, where the states cost (k+1)*H*2."""
    offsets = [0]
    for ids, _ in rows:
        offsets.append(offsets[-1] + len(ids))
    return {
        "input_ids": torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.long),
        "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.bool),
        "seq_offsets": torch.tensor(offsets, dtype=torch.long),
    }


def read_tokens_record(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(arrays, header metadata as written) of a tokens record; UserError naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            arrays = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "seq_offsets")}
            return arrays, dict(f.metadata() or {})
    except FileNotFoundError:
        raise UserError(f"{path}: tokens record not found; re-run the extract stage with train.features online") from None
    except Exception as e:  # noqa: BLE001 - damaged or foreign file
        raise UserError(f"{path}: not a readable tokens record ({e}); re-run the extract stage") from None
