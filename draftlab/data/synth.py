"""Synthesis: the target answers every prompt; resumable, with two interchangeable backends.

Backends (synth.backend):
  hf      in-process transformers, batched with left padding (the default; offline, CPU works)
  openai  any OpenAI-compatible server (SGLang, vLLM, the reference server): bounded
          concurrency, per-request timeout, retries with exponential backoff; rows that still
          fail go to errors.jsonl with the reason.

Both call `answer(rows, done)` and report each prompt through `done(row, Reply | None, error)`.

Conversations (prompt rows with "next_turns", prompts.turns all): the target answers turn k with
its own answers to turns 1..k-1 in the chat template, never the source's recorded answers. The hf
backend goes round by round (every conversation's turn k in one set of batches); the openai
backend runs each conversation's turns in sequence inside one worker, so `concurrency`
conversations are in flight and no round waits for its slowest answer. An answer cut at
max_new_tokens (finish_reason "length") stays in the history as the target wrote it and the next
turn is asked after it (synth.after_cut continue; stop ends the conversation there instead,
stopped "length"): a target that often runs to the cap would otherwise lose most later turns.
Each answer's finish reason is kept (Reply.finish_reasons; the row's "finish_reasons"), so that
extraction does not teach the end-of-turn token the template puts after a cut answer. A
conversation ends early when its next turn plus max_new_tokens would not fit the target's context
(stopped "context"); the turns answered so far are kept. A first turn that does not fit is an
error before any generation (check_context).

Reasoning (synth.reasoning):
  keep  the assistant content as the target's chat template renders it: `<think>`, the
        reasoning, `</think>`, the answer. The hf backend sees this text inline and stores it
        exactly as generated. A server running a reasoning parser returns the reasoning
        separately (`reasoning_content`), having stripped the markers and, depending on its
        version, surrounding whitespace; we rebuild the content with the layout the chat
        template uses for an assistant turn with reasoning (probed once from the template,
        e.g. "<think>\n" + reasoning + "\n</think>\n" + answer). ASSUMPTION: the target writes
        its reasoning in that same layout; a target that does not would give content that
        differs from the hf backend's in whitespace only.
  drop  only the answer after `</think>`.

Resume: each finished row (a conversation: all its turns answered) is appended to
`<split>.jsonl.partial` and flushed at once. A rerun
with the same resume key (`resume_key`) keeps those rows, discards a torn last line, skips
their ids and generates only the rest; the final `<split>.jsonl` is written in input order, so
it does not depend on completion order, concurrency or interruptions.

Reuse: the finished outputs of the last run answer the next one's prompts where they can. Its
resume key is kept in `.answers.json` once every output is written; a run with the same key
takes a row of the earlier `<split>.jsonl` files (either split) for any prompt row it follows
exactly (same id, same user turns), and answers only the rest. So a prompt set that grows
(prompts.leading_assistant drop, more prompts) costs only its new conversations. A run with
another key removes that marker before it writes anything. `plan` says what is left before any
backend exists, so a stage with nothing left starts no server and loads no model (`Answered`).

Length: over 400 lines because both backends, the reasoning layout and resume share the row
and answer types here; each is a short class or function.
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, canonical_json
from draftlab import jsonl
from draftlab.data.answers import FINISH_REASONS, finish_reasons, finish_reasons_problem
from draftlab.data.tasks import END_THINK, THINK

SPLITS = ("train", "eval")
RESUME_FILE = ".resume.json"  # the resume key of the partial files next to it
ANSWERS_FILE = ".answers.json"  # the resume key of the finished <split>.jsonl files next to it (reuse)
MAX_BACKOFF_S = 60.0  # cap of one retry delay (also for a server's Retry-After)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}  # transient: overloaded, restarting, timed out
# Consecutive connection failures (refused, unreachable; any row) after which the server is taken
# for dead and synthesis stops naming the URL: retrying every row would take minutes to say so.
DEAD_SERVER_FAILURES = 3
WORKERS_PER_CLIENT = 16  # conversations in flight per HTTP client (see OpenAIBackend._answer_all)


@dataclass
class Answer:
    content: str  # the assistant message content to store
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens reached)
    completion_tokens: int  # generated tokens, the EOS included (as servers count them)


@dataclass
class Reply:
    """The target's answers to one prompt row: one per user turn asked, in order."""
    answers: list[Answer]
    stopped: str | None = None  # a conversation ended before its last user turn: "length" (a cut answer, after_cut stop) or "context"

    @property
    def finish_reason(self) -> str:  # of the last answer
        return self.answers[-1].finish_reason

    @property
    def finish_reasons(self) -> list[str]:  # of each answer, in order
        return [a.finish_reason for a in self.answers]

    @property
    def completion_tokens(self) -> int:  # over every turn
        return sum(a.completion_tokens for a in self.answers)


Done = Callable[[dict, "Reply | None", "str | None"], None]


class Dialogue:
    """One prompt row answered turn by turn: what the next request sends, and the answers so far."""

    def __init__(self, row: dict, tok, context_length: int, max_new_tokens: int, after_cut: str = "continue"):
        self.row, self.tok, self.context_length, self.max_new_tokens = row, tok, context_length, max_new_tokens
        self.after_cut = after_cut  # synth.after_cut: what a cut answer does to the rest of the conversation
        self.messages = list(row["messages"])  # the prompt of the turn being asked
        self.left = list(row.get("next_turns") or ())  # user turns not asked yet
        self.reply = Reply([])
        self.ids: list[int] | None = None  # the prompt's token ids, once measured

    @property
    def turn(self) -> int:  # 1-based, the turn being asked
        return len(self.reply.answers) + 1

    def prompt_ids(self) -> list[int]:
        if self.ids is None:
            self.ids = prompt_ids(self.tok, self.messages)
        return self.ids

    def seed_key(self) -> str:
        """What a turn's sampling seed derives from: the row id for turn 1 (as for a single turn)."""
        return self.row["id"] if self.turn == 1 else f"{self.row['id']}:turn{self.turn}"

    def advance(self, ans: Answer) -> bool:
        """Record the answer to the turn asked; True when the next turn is to be asked (self.messages)."""
        self.reply.answers.append(ans)
        if not self.left:
            return False
        if ans.finish_reason != "stop" and self.after_cut == "stop":
            self.reply.stopped = "length"
            return False
        # A cut answer goes on as the target wrote it: what a client that keeps it would send next.
        nxt = self.messages + [{"role": "assistant", "content": ans.content}, {"role": "user", "content": self.left[0]}]
        ids = prompt_ids(self.tok, nxt)
        if len(ids) + self.max_new_tokens > self.context_length:
            self.reply.stopped = "context"
            return False
        self.messages, self.ids = nxt, ids
        self.left.pop(0)
        return True


def conversation(prompt: dict, reply: Reply) -> list[dict]:
    """The whole regenerated conversation of a prompt row: its messages, answer 1, user turn 2, answer 2, ..."""
    out = list(prompt["messages"])
    later = prompt.get("next_turns") or []
    for k, ans in enumerate(reply.answers):
        if k:
            out.append({"role": "user", "content": later[k - 1]})
        out.append({"role": "assistant", "content": ans.content})
    return out


def follows(row: dict, prompt: dict) -> bool:
    """Whether an answer row (a partial file's) answers this very prompt row: its messages, then
    answers alternating with the prompt's later user turns, in order, ending with an answer."""
    n, msgs = len(prompt["messages"]), row["messages"]
    tail, later = msgs[n:], prompt.get("next_turns") or []
    if msgs[:n] != prompt["messages"] or len(tail) % 2 == 0 or len(tail) // 2 > len(later):
        return False
    want = conversation(prompt, Reply([Answer(m["content"], "stop", 0) for m in tail[::2]]))
    return msgs == want


# ---------------------------------------------------------------------------------------------
# Prompts


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a prompts JSONL file; ids must be unique (they key resume and dedupe)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: not found; run the prompts stage first (dvc repro prompts)")
    rows, seen = [], set()
    for n, row in jsonl.read(path, "re-run the prompts stage (dvc repro -f prompts)"):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise UserError(f"{path}:{n}: a prompt row needs 'id' (string) and 'messages' (non-empty list)")
        if row["messages"][-1].get("role") != "user":
            raise UserError(f"{path}:{n}: row {row['id']}: the last message must be from the user")
        later = row.get("next_turns", [])
        if not isinstance(later, list) or not all(isinstance(t, str) and t.strip() for t in later):
            raise UserError(f"{path}:{n}: row {row['id']}: 'next_turns' must be a list of non-empty strings (the later "
                            "user turns); re-run the prompts stage (dvc repro -f prompts)")
        if row["id"] in seen:
            raise UserError(f"{path}:{n}: duplicate prompt id {row['id']}")
        seen.add(row["id"])
        rows.append(row)
    return rows


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant header (what the target continues)."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def check_context(splits: dict[str, list[dict]], tok, context_length: int, max_new_tokens: int) -> None:
    """Every prompt (a conversation's first turn) plus max_new_tokens must fit the target's context;
    else name the rows. A later turn that would not fit ends its conversation instead (Dialogue)."""
    bad = []
    for split, rows in splits.items():
        for row in rows:
            n = len(prompt_ids(tok, row["messages"]))
            if n + max_new_tokens > context_length:
                bad.append(f"row {row['id']} ({split}): {n} prompt tokens + synth.max_new_tokens {max_new_tokens}")
    if bad:
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise UserError(
            f"{len(bad)} prompt(s) do not fit the target's context of {context_length} tokens:\n  "
            + "\n  ".join(bad[:10]) + more + "\nshorten or drop those prompts, or lower synth.max_new_tokens"
        )


def row_seed(seed: int, row_id: str) -> int:
    """A per-row sampling seed: the same row gets the same seed in any order or rerun."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:4], "little")


# ---------------------------------------------------------------------------------------------
# Reasoning


def think_layout(tok) -> tuple[str, str]:
    """(opening, middle) the chat template puts around an assistant turn's reasoning.

    For the tiny target: ("<think>\\n", "\\n</think>\\n"), i.e. content = opening + reasoning +
    middle + answer. Falls back to that layout when the template drops `reasoning_content`.
    """
    r_mark, a_mark = "@@REASONING@@", "@@ANSWER@@"
    user = [{"role": "user", "content": "q"}]
    try:
        prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(user + [{"role": "assistant", "content": a_mark, "reasoning_content": r_mark}], tokenize=False)
    except Exception:  # a template may reject the extra key; then use the common layout
        prompt = full = ""
    if full.startswith(prompt) and r_mark in full and a_mark in full:
        opening, rest = full[len(prompt):].split(r_mark, 1)
        middle = rest.split(a_mark, 1)[0]
        if THINK in opening and END_THINK in middle:
            return opening[opening.index(THINK):], middle
    return f"{THINK}\n", f"\n{END_THINK}\n"


def answer_only(text: str) -> str:
    """The answer after `</think>`; "" when the text was cut off while still reasoning."""
    if END_THINK in text:
        return text.split(END_THINK, 1)[1].lstrip()
    if text.lstrip().startswith(THINK):
        return ""
    return text


def rebuild_content(reasoning: str | None, answer: str | None, layout: tuple[str, str], finish_reason: str) -> str:
    """The inline content the hf backend would store, from a server's separate reasoning."""
    answer = answer or ""
    if not reasoning:  # no parser on the server, or no reasoning: the content is already inline
        return answer
    opening, middle = layout
    if not answer and finish_reason == "length":  # cut off before </think>
        return opening + reasoning.strip()
    return opening + reasoning.strip() + middle + answer.strip()


# ---------------------------------------------------------------------------------------------
# Backends


class HFBackend:
    """In-process generation: prompts sorted by length, batched with left padding."""

    def __init__(self, model, tok, synth_params, device: str):
        self.model, self.tokenizer, self.synth_params, self.device = model, tok, synth_params, device
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context_length = getattr(cfg, "max_position_embeddings", None) or tok.model_max_length
        eos = model.generation_config.eos_token_id
        self.eos_ids = sorted({i for i in [*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id] if i is not None})
        self.info = {}

    def answer(self, rows: list[dict], done: Done) -> None:
        """Round by round: every conversation's turn k, then the turn k+1 of those that go on."""
        synth_params = self.synth_params
        active = [Dialogue(r, self.tokenizer, self.context_length, synth_params.max_new_tokens, synth_params.after_cut)
                  for r in rows]
        while active:
            going = []
            for dialogue, ans in self._round(active):
                if dialogue.advance(ans):
                    going.append(dialogue)
                else:
                    done(dialogue.row, dialogue.reply, None)
            active = going

    def _round(self, dialogues: list[Dialogue]):
        """(dialogue, its answer to the turn asked), batch by batch."""
        import torch

        synth_params, tok = self.synth_params, self.tokenizer
        encoded = sorted(((d.prompt_ids(), d) for d in dialogues), key=lambda x: -len(x[0]))  # longest first: OOM shows at once
        for i in range(0, len(encoded), synth_params.batch_size):
            batch = encoded[i:i + synth_params.batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids, _ in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=self.device)
            sampled = synth_params.temperature > 0
            with torch.random.fork_rng(devices=[]), torch.inference_mode():
                torch.manual_seed(row_seed(synth_params.seed, batch[0][1].seed_key()))
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=mask, max_new_tokens=synth_params.max_new_tokens,
                    do_sample=sampled, temperature=synth_params.temperature if sampled else None, top_p=synth_params.top_p if sampled else None,
                    # Only our settings shape the answer: no top-k or repetition penalty from the
                    # target's generation_config.json (the openai backend does not send them either).
                    top_k=0 if sampled else None, repetition_penalty=1.0,
                    pad_token_id=tok.pad_token_id, eos_token_id=self.eos_ids,
                )
            for (ids, dialogue), seq in zip(batch, out[:, width:].tolist()):
                stop = next((k for k, t in enumerate(seq) if t in self.eos_ids), None)
                gen = seq[: stop + 1] if stop is not None else seq
                text = tok.decode(gen, skip_special_tokens=True)
                content = text if synth_params.reasoning == "keep" else answer_only(text)
                yield dialogue, Answer(content, "stop" if stop is not None else "length", len(gen))


class OpenAIBackend:
    """Chat completions against an OpenAI-compatible server, `concurrency` conversations in flight
    (each one's turns in sequence, in one worker)."""

    def __init__(self, tok, synth_params, context_length: int, api_key: str | None = None,
                 base_urls: list[str] | None = None):
        """base_urls: the servers' URLs up to /v1 (default [synth.base_url]; the sglang backend's own
        servers). Several servers of one target share the load by conversation (`_url`)."""
        self.tokenizer, self.synth_params, self.context_length = tok, synth_params, context_length
        self.base_urls = [u.rstrip("/") for u in (base_urls or [synth_params.base_url])]
        self.base_url = self.base_urls[0]  # the one asked for the model name; the one named in messages
        self.in_flight = dict.fromkeys(self.base_urls, 0)  # conversations in flight per server (one event loop: no lock)
        self.assigned: dict[str, str] = {}  # row id -> its server, while the conversation runs
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="synth-tokenize")
        self.sent = dict.fromkeys(self.base_urls, 0)  # requests sent per server, retries included
        self._key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.layout = think_layout(tok)
        self.connect_failures = 0  # consecutive, over all rows: reset by any answer
        self.model_name = synth_params.model_name or self._served_model()
        self.info = {"served_model": self.model_name, "reasoning_layout": list(self.layout), "servers": len(self.base_urls)}

    def _url(self, row: dict) -> str:
        """The server that answers `row`, every turn of it: the one with the fewest conversations in
        flight when its first turn is asked (ties: the first listed), then the same one, whose prefix
        cache holds the conversation so far."""
        url = self.assigned.get(row["id"])
        if url is None:
            url = self.assigned[row["id"]] = min(self.base_urls, key=self.in_flight.__getitem__)
            self.in_flight[url] += 1
        return url

    def _release(self, row: dict) -> None:
        url = self.assigned.pop(row["id"], None)
        if url is not None:
            self.in_flight[url] -= 1

    def redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def _served_model(self) -> str:
        url = f"{self.base_url}/models"
        try:
            r = httpx.get(url, headers=self.headers, timeout=self.synth_params.timeout_s, trust_env=False)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise UserError(
                f"synth.base_url: cannot list models at {url} ({self.redact(f'{type(e).__name__}: {e}')}); "
                "start the server, or set synth.model_name"
            ) from None

    def answer(self, rows: list[dict], done: Done) -> None:
        try:
            asyncio.run(self._answer_all(rows, done))
        finally:
            self.info["requests_per_server"] = list(self.sent.values())  # in base_urls order: how evenly the load spread

    async def _answer_all(self, rows: list[dict], done: Done) -> None:
        queue = list(reversed(rows))  # workers pop from the end: input order
        workers = max(1, self.synth_params.concurrency)
        # httpx's pool scans every connection it holds for each request it places: one client for
        # 1,024 requests in flight spent 85% of the client's time there (15k tok/s from servers that
        # can give 60k). Clients of WORKERS_PER_CLIENT workers each keep that scan short; each keeps
        # every connection it opens (keep-alive), so no request pays for a new one.
        n_clients = -(-workers // WORKERS_PER_CLIENT)
        size = WORKERS_PER_CLIENT * len(self.base_urls)  # a worker's conversations may go to any server
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(httpx.AsyncClient(
                headers=self.headers, timeout=self.synth_params.timeout_s, limits=limits, trust_env=False)) for _ in range(n_clients)]

            async def worker(client):
                while queue:
                    row = queue.pop()
                    reply, err = await self._converse(client, row)
                    done(row, reply, err)

            await asyncio.gather(*(worker(clients[w // WORKERS_PER_CLIENT]) for w in range(workers)))

    async def _converse(self, client: httpx.AsyncClient, row: dict) -> tuple[Reply | None, str | None]:
        """Every turn of one prompt row, in sequence; a failed turn fails the row (a rerun asks it again
        from its first turn: only whole conversations are kept)."""
        dialogue = Dialogue(row, self.tokenizer, self.context_length, self.synth_params.max_new_tokens,
                            self.synth_params.after_cut)
        turns = 1 + len(dialogue.left)
        try:
            while True:
                ans, err = await self._answer_one(client, row, dialogue.messages, dialogue.seed_key())
                if ans is None:
                    return None, err if turns == 1 else f"turn {dialogue.turn} of {turns}: {err}"
                # advance() renders and tokenizes the conversation so far (its context check): in one worker
                # thread (a fast tokenizer shared by threads can fail "Already borrowed"), so the event loop
                # keeps every other request going meanwhile.
                if not await asyncio.get_running_loop().run_in_executor(self.tokenizing, dialogue.advance, ans):
                    return dialogue.reply, None
        finally:
            self._release(row)

    async def _answer_one(self, client: httpx.AsyncClient, row: dict, messages: list[dict], seed_key: str
                          ) -> tuple[Answer | None, str | None]:
        synth_params = self.synth_params
        body = {
            "model": self.model_name,
            "messages": messages,
            "max_tokens": synth_params.max_new_tokens,
            "temperature": synth_params.temperature,
            "top_p": synth_params.top_p,
            "seed": row_seed(synth_params.seed, seed_key),
            "stream": False,
        }
        reason, retry_after = "not attempted", None
        for attempt in range(synth_params.max_retries + 1):
            if attempt:
                await asyncio.sleep(_backoff(synth_params.retry_backoff_s, attempt, retry_after))
            retry_after = None
            url = self._url(row)
            self.sent[url] += 1
            try:
                r = await client.post(f"{url}/chat/completions", json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                reason = f"{type(e).__name__}: {e}"
                self.connect_failures += 1
                if self.connect_failures >= DEAD_SERVER_FAILURES:
                    raise UserError(
                        f"synth.base_url: cannot connect to {url} ({self.redact(reason)}; "
                        f"{self.connect_failures} attempts in a row); start the server or fix the URL, then re-run: "
                        "the answers already written are kept"
                    ) from None
                continue
            except httpx.TimeoutException as e:
                reason = f"{type(e).__name__}: no answer within synth.timeout_s={synth_params.timeout_s:g} s"
                continue
            except httpx.HTTPError as e:
                reason = f"{type(e).__name__}: {e}"
                continue
            self.connect_failures = 0
            if r.status_code != 200:
                reason = f"HTTP {r.status_code}: {r.text[:300]}"
                retry_after = r.headers.get("retry-after")
                if r.status_code in RETRY_STATUS:
                    continue
                break  # a 4xx other than those will fail the same way again
            try:
                return self._parse(r.json()), None
            except (ValueError, KeyError, IndexError, TypeError) as e:
                reason = f"unusable response ({type(e).__name__}: {e}): {r.text[:300]}"
        attempts = attempt + 1
        return None, self.redact(f"{reason} (after {attempts} attempt{'s' * (attempts > 1)})")

    def _parse(self, data: dict) -> Answer:
        choice = data["choices"][0]
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise ValueError(f"finish_reason {finish!r}")
        msg = choice["message"]
        # SGLang names it reasoning_content; some servers (newer vLLM) name it reasoning
        content, reasoning = msg.get("content") or "", msg.get("reasoning_content") or msg.get("reasoning")
        if self.synth_params.reasoning == "keep":
            content = rebuild_content(reasoning, content, self.layout, finish)
        elif not reasoning:  # no parser on the server: the reasoning is inline
            content = answer_only(content)
        return Answer(content, finish, int(data["usage"]["completion_tokens"]))


def _backoff(base_s: float, attempt: int, retry_after: str | None) -> float:
    """Seconds before retry `attempt` (1-based): base * 2^(attempt-1) with +-25% jitter, or Retry-After."""
    if retry_after and retry_after.strip().isdigit():
        return min(float(retry_after), MAX_BACKOFF_S)
    return min(base_s * 2 ** (attempt - 1) * random.uniform(0.75, 1.25), MAX_BACKOFF_S)


# ---------------------------------------------------------------------------------------------
# Resumable output


def resume_key(target: dict, synth: dict, inputs: dict) -> str:
    """What must match for rows of a partial or finished file to be reused: the target, its weights
    (`inputs`) and the settings that change an answer.

    Transport settings (base_url, api key name, batch size, concurrency, timeout, retries) may
    change between an interrupted run and its resume. The prompts are not part of it: a row is
    reused only for a prompt row of its id (the hash of the conversation's user turns) that it
    follows exactly.
    """
    content = {k: synth[k] for k in ("backend", "model_name", "max_new_tokens", "temperature", "top_p", "seed", "reasoning",
                                     "after_cut")}
    return hashlib.sha256(canonical_json({"target": target, "synth": content, "inputs": inputs}).encode()).hexdigest()


def earlier_answers(out: Path, key: str | None) -> dict[str, dict]:
    """The finished rows of the last run in `out` by id, if it ran under resume key `key`; else none, and
    the marker is removed so that files this run rewrites are never vouched for by another key.
    Lines that are not answer rows are passed over: these files are a source to reuse, not state."""
    marker = out / ANSWERS_FILE
    try:
        same = key is not None and json.loads(marker.read_text())["key"] == key
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    if not same:
        marker.unlink(missing_ok=True)
        return {}
    rows: dict[str, dict] = {}
    for split in SPLITS:
        path = out / f"{split}.jsonl"
        if not path.is_file():
            continue
        for n, raw in jsonl.lines(path):
            try:
                row = jsonl.loads_line(path, n, raw, "")
            except UserError:  # not JSON: not a row to reuse
                continue
            if row_problem(row) is None:
                rows.setdefault(row["id"], row)
    return rows


def row_problem(row) -> str | None:
    """Why a line of a partial file is not an answer row as synthesize writes it (make_row), or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an answer row (an object with id, messages, finish_reason, completion_tokens)"
    if not isinstance(row.get("id"), str) or not row["id"]:
        return "no 'id' (a non-empty string)"
    msgs = row.get("messages")
    if not (isinstance(msgs, list) and len(msgs) >= 2 and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                                and isinstance(m.get("content"), str) for m in msgs)):
        return f"row {row['id']}: 'messages' must be a list of {{role, content}} objects, the prompt then the answer"
    if msgs[-1]["role"] != "assistant":
        return f"row {row['id']}: the last message must be the assistant's answer, got role {msgs[-1]['role']!r}"
    if row.get("finish_reason") not in FINISH_REASONS:
        return f"row {row['id']}: 'finish_reason' must be \"stop\" or \"length\", got {row.get('finish_reason')!r}"
    tokens = row.get("completion_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return f"row {row['id']}: 'completion_tokens' must be an integer >= 0, got {tokens!r}"
    turns = row.get("turns", 1)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        return f"row {row['id']}: 'turns' must be an integer >= 1 (the turns answered), got {turns!r}"
    if row.get("stopped") not in (None, "length", "context"):
        return f"row {row['id']}: 'stopped' must be \"length\" or \"context\" when present, got {row.get('stopped')!r}"
    problem = finish_reasons_problem(row)
    return f"row {row['id']}: {problem}" if problem else None


def load_partial(path: Path) -> dict[str, dict]:
    """Rows of a partial file by id; a torn last line (killed mid-write) is cut off the file. Any
    other line that is not an answer row (not JSON, not UTF-8, valid JSON of another shape) is a
    UserError naming file:line: the file is resume state, and a row that was not written by
    synthesize must not reach the final files."""
    rows: dict[str, dict] = {}
    if not path.exists():
        return rows
    if not path.is_file():
        raise UserError(f"{path} is not a file, so the answers of this split cannot be kept there; move or delete it")
    data = path.read_bytes()
    fix = f"delete that line, or delete {path} to answer this split over (the other split's answers are kept)"
    good_end, pos, n = 0, 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: the write was interrupted
        n += 1
        line = data[pos:nl]
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            if data.find(b"\n", nl + 1) >= 0:  # a bad line with complete lines after it: not a torn tail
                what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "not valid JSON"
                raise UserError(f"{path}:{n}: {what}; {fix}") from None
            break
        problem = row_problem(row)
        if problem:
            raise UserError(f"{path}:{n}: {problem}; {fix}")
        rows.setdefault(row["id"], row)  # first copy wins (duplicates cannot be written, but never keep two)
        good_end = pos = nl + 1
    if good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def prepare_resume(out: Path, key: str) -> bool:
    """Keep partial files written under `key`, else remove them; returns whether any are kept."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RESUME_FILE
    partials = [out / f"{s}.jsonl.partial" for s in SPLITS]
    for p in partials:
        if p.exists() and not p.is_file():  # not ours to remove: it may hold anything
            raise UserError(f"{p} is not a file, so the answers of this split cannot be kept there; move or delete it")
    try:
        same = json.loads(marker.read_text())["key"] == key
    except (OSError, ValueError, KeyError, TypeError):  # absent, damaged or of another shape: start over
        same = False
    if not same:
        for p in partials:
            p.unlink(missing_ok=True)
        atomic_write_json(marker, {"key": key})
    return same and any(p.exists() for p in partials)


def count_row(stats: dict, row: dict) -> None:
    """Add one output row to the stats: its last answer's finish reason, every answer's, its turns and
    why it stopped early."""
    def bump(counts: dict, key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    bump(stats["finish_reasons"], row["finish_reason"])
    for reason in finish_reasons(row):  # a cut answer no longer ends its conversation: count each one
        bump(stats["answer_finish_reasons"], reason)
    stats["turns"] += row.get("turns", 1)  # a row of one turn carries no count
    if row.get("stopped"):
        bump(stats["stopped"], row["stopped"])


def longest_first(rows: list[dict]) -> list[dict]:
    """The rows in the order the backend takes them: conversations of more user turns first (stable).

    A conversation's turns are asked one after another, so one of 20 turns takes 20 answers' time
    whatever the concurrency. Sent last, the longest ones ran alone at the end of the stage: the
    real workload's last 236 of 9,536 conversations took 28 s of a 198 s generation. Started first,
    they run beside the short ones. The files keep the input order, and no answer depends on when
    its row was sent (seeds are per row)."""
    return sorted(rows, key=lambda r: -len(r.get("next_turns") or ()))


@dataclass
class Plan:
    """What a run of synthesize has to answer: the rows answered already (kept from a partial file of
    this resume key, or reused from the last finished run) and the rest, in the order sent."""
    resumed: bool  # partial files of this key were kept
    done_rows: dict[str, dict[str, dict]]  # split -> id -> output row
    reused: dict[str, int]  # split -> rows taken from the last finished run
    todo: list[dict]  # prompt rows still to answer, longest conversations first
    split_of: dict[int, str]  # id() of a todo row -> its split


def plan(splits: dict[str, list[dict]], out: Path, key: str, reuse: bool = False) -> Plan:
    """The rows of `splits` answered already in `out` under resume key `key` and those left (`synthesize`'s
    first half: a stage asks it before starting servers, and starts none when nothing is left). A reused
    row takes this run's `source` (the prompt file it came from may have another name now)."""
    resumed = prepare_resume(out, key)
    earlier = earlier_answers(out, key if reuse else None)
    reused = {split: 0 for split in splits}
    done_rows: dict[str, dict[str, dict]] = {}
    todo: list[dict] = []
    split_of: dict[int, str] = {}  # id() of a prompt row handed to the backend -> its split
    for split, rows in splits.items():
        partial = out / f"{split}.jsonl.partial"
        done = load_partial(partial)
        wanted = {r["id"] for r in rows}
        done = {i: r for i, r in done.items() if i in wanted}
        for prow in rows:  # the id is the prompt's content hash: a kept answer must follow that very prompt
            if prow["id"] in done and not follows(done[prow["id"]], prow):
                raise UserError(f"{partial}: row {prow['id']} holds other prompt messages than that prompt's row in "
                                f"{split}.jsonl of the prompts; delete that line, or delete {partial} to answer this split over")
        done_rows[split] = done
        for r in rows:
            if r["id"] not in done and r["id"] in earlier and follows(earlier[r["id"]], r):
                kept = {k: v for k, v in earlier[r["id"]].items() if k != "source"}  # the last run's answer to this very
                done[r["id"]] = kept | ({"source": r["source"]} if "source" in r else {})  # conversation, from this run's source
                reused[split] += 1
            elif r["id"] not in done:
                todo.append(r)
                split_of[id(r)] = split
    return Plan(resumed, done_rows, reused, longest_first(todo), split_of)


class Answered:
    """The backend of a run with nothing left to answer: the target's tokenizer and context length for
    the checks and hashes, and no server or model (none is started or loaded)."""

    def __init__(self, tok, context_length: int):
        self.tokenizer, self.context_length = tok, context_length
        self.info = {"served_model": None, "servers": 0}

    def answer(self, rows: list[dict], done) -> None:
        if rows:
            raise RuntimeError(f"{len(rows)} rows to answer, but no backend was started: plan() said none were left")


def synthesize(splits: dict[str, list[dict]], backend, out: Path, key: str, make_row: Callable, progress=None,
               reuse: bool = False, planned: Plan | None = None) -> dict:
    """Answer every row of every split into `out` under resume key `key`; returns counts and token
    figures. `reuse`: rows of the last finished run under the same key answer this run's prompts too
    (module docstring). `planned`: `plan()`'s result when the caller asked it first (same key and reuse).

    Every split's rows go to the backend at once, one pool of workers: a split answered after
    another would run its own ramp and tail (the 482 eval conversations of the real workload
    took 67 s at a third of the rate, after the train split). `make_row(prompt_row, reply)`
    builds the output row; `progress(name, total, initial)` returns a tqdm-like bar (or None).
    """
    import time

    planned = planned or plan(splits, out, key, reuse)
    resumed, done_rows, reused, todo, split_of = (planned.resumed, planned.done_rows, planned.reused, planned.todo,
                                                  planned.split_of)
    stats = {"resumed": resumed, "counts": {}, "completion_tokens": 0, "generation_s": 0.0, "finish_reasons": {},
             "answer_finish_reasons": {}, "turns": 0, "stopped": {}}
    errors: list[dict] = []
    total, kept = sum(map(len, splits.values())), sum(map(len, done_rows.values()))
    bar = progress("+".join(splits), total, kept) if progress else None
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        files = {split: stack.enter_context(open(out / f"{split}.jsonl.partial", "a", encoding="utf-8")) for split in splits}

        def finished(prow, ans, err):
            split = split_of[id(prow)]
            if ans is None:
                errors.append({"id": prow["id"], "split": split, "error": err})
            else:
                row = make_row(prow, ans)
                files[split].write(jsonl.dumps(row))
                files[split].flush()  # on disk for a resume even after kill -9
                done_rows[split][prow["id"]] = row
                stats["completion_tokens"] += ans.completion_tokens
            if bar is not None:
                bar.update(1)
                rate = stats["completion_tokens"] / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}", errors=len(errors), refresh=False)

        try:
            backend.answer(todo, finished)
        finally:
            if bar is not None:
                bar.close()
            stats["generation_s"] += time.perf_counter() - t0
        for f in files.values():
            os.fsync(f.fileno())
    for split, rows in splits.items():
        kept_before = sum(1 for r in rows if id(r) not in split_of)
        stats["counts"][split] = {"input": len(rows), "resumed": kept_before - reused[split], "reused": reused[split],
                                  "ok": len(done_rows[split]), "errors": sum(e["split"] == split for e in errors)}
    # Only now, with every split generated, do the partial files become outputs.
    for split, rows in splits.items():
        done = done_rows[split]
        for r in done.values():
            count_row(stats, r)
        jsonl.write(out / f"{split}.jsonl", (done[r["id"]] for r in rows if r["id"] in done))
    jsonl.write(out / "errors.jsonl", errors)
    for split in splits:
        (out / f"{split}.jsonl.partial").unlink(missing_ok=True)
    (out / RESUME_FILE).unlink(missing_ok=True)
    if reuse:  # every output written: they answer under this key
        atomic_write_json(out / ANSWERS_FILE, {"key": key})
    stats["errors"] = errors
    stats["reused"] = sum(reused.values())
    return stats
