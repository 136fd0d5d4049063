"""Stage synthesize: the target answers every prompt of both splits.

    python -m stages.synthesize --prompts data/prompts --out data/synth
Reads params sections: target, synth.
Writes data/synth/{train,eval}.jsonl, errors.jsonl, manifest.json. Interrupted (Ctrl-C, kill)?
Run it again: finished rows are kept and only the rest is generated.
Every output row holds "finish_reasons", one per answer ("stop", or "length": cut at
synth.max_new_tokens), the last answer's "finish_reason" and the completion_tokens of every turn
(draftlab/data/answers.py). A prompt row with later user turns (prompts.turns all) is answered turn
by turn, each after the target's answers so far, a cut one included (synth.after_cut continue); its
output row holds the whole regenerated conversation, "turns" (answered) and "stopped" when it ended
before its last user turn ("context": the next turn would not fit; "length": an answer was cut, with
synth.after_cut stop).

synth.backend sglang: the stage starts `python -m sglang.launch_server` for the target (the folder
every stage loads: a GGUF target's dequantized one) in target.dtype on a free port, with
synth.server_args, waits for /health, answers through its OpenAI-compatible API exactly as the
openai backend does, and stops it (on an error or Ctrl-C too). Its log is data/synth/.sglang-server.log
(a dot file: not part of the outputs' hash). Where each server's start-up went (imports, weights, CUDA
graphs, ...: draftlab.sglang.startup) is printed and kept in the manifest's info.server_startup.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from draftlab.data import synth
from draftlab.cli import run_stage_cli
from draftlab.errors import UserError
from draftlab.manifest import MANIFEST, build_manifest, dir_hash, output_files, read_verified, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.parallel import resolve_device
from draftlab.progress import bar
from draftlab.sglang.target_servers import SERVER_MANAGED, own_servers
from draftlab.target.load import (chat_template_hash, load_config, load_target, load_tokenizer, target_fingerprint,
                             tokenizer_hash)


def make_backend(target_params, synth_params, base_urls: list[str] | None = None):
    if synth_params.backend == "hf":
        device = resolve_device(target_params.device)
        model, tok = load_target(target_params, device)
        return synth.HFBackend(model, tok, synth_params, device)
    tok, context = tokenizer_and_context(target_params)
    return synth.OpenAIBackend(tok, synth_params, context, api_key=os.environ.get(synth_params.api_key_env) or None, base_urls=base_urls)


def tokenizer_and_context(target_params):
    """The target's own tokenizer (context check, hashes, think layout) and context length, without its weights."""
    tok = load_tokenizer(target_params.model, target_params.revision)
    cfg = load_config(target_params).get_text_config()
    return tok, getattr(cfg, "max_position_embeddings", None) or tok.model_max_length


def answers_key(params, inputs: dict) -> str:
    """The resume key the answers are kept under: the target, its weights and the sampling, not the prompts
    (a row is reused only for the conversation its id hashes)."""
    return synth.resume_key(dataclasses.asdict(params.target), dataclasses.asdict(params.synth), {"target": inputs["target"]})


def main(prompts_dir: Path, out: Path) -> None:
    params = load_params(["target", "synth"])
    target_params, synth_params = params.target, params.synth
    upstream = read_verified(prompts_dir)  # the prompt files as the prompts stage wrote them
    splits = {s: synth.read_prompts(prompts_dir / f"{s}.jsonl") for s in synth.SPLITS}
    inputs = {"prompts": upstream["config_hash"], "target": target_fingerprint(target_params)}
    (out / MANIFEST).unlink(missing_ok=True)  # a manifest vouches for complete outputs only
    from draftlab.sglang.launch import check_extra_args

    check_extra_args(synth_params.server_args, "synth.server_args", SERVER_MANAGED)  # before any server starts
    planned = synth.plan(splits, out, answers_key(params, inputs), reuse=True)
    if not planned.todo:  # every conversation answered already (resumed or the last run's): no server, no model
        reused = sum(planned.reused.values())
        print(f"synthesize: every conversation is answered already ({reused} by the last finished run, "
              f"{sum(map(len, planned.done_rows.values())) - reused} resumed): no server started, no model loaded")
        run(params, splits, inputs, out, synth.Answered(*tokenizer_and_context(target_params)), [], planned)
        return
    startups: list = []
    with own_servers(target_params, synth_params, out, startups) if synth_params.backend == "sglang" else contextlib.nullcontext() as urls:
        run(params, splits, inputs, out, make_backend(target_params, synth_params, urls), startups, planned)


def run(params, splits, inputs, out: Path, backend, server_startup: list | None = None, planned=None) -> None:
    """server_startup: where each server's start-up went (own_servers), kept in the manifest. planned:
    synth.plan()'s result, when main() asked it before starting servers."""
    target_params, synth_params = params.target, params.synth
    tok = backend.tokenizer
    synth.check_context(splits, tok, backend.context_length, synth_params.max_new_tokens)

    sampling = {"temperature": synth_params.temperature, "top_p": synth_params.top_p, "max_new_tokens": synth_params.max_new_tokens, "seed": synth_params.seed}

    def make_row(prompt, reply: synth.Reply) -> dict:
        row = {
            "id": prompt["id"],
            "messages": synth.conversation(prompt, reply),
            "model": target_params.model,
            "revision": target_params.revision,
            "sampling": sampling,
            "finish_reason": reply.finish_reason,  # of the last answer
            "finish_reasons": reply.finish_reasons,  # of each answer: which ones were cut (extract masks after them)
            "completion_tokens": reply.completion_tokens,  # of every turn
        }
        if prompt.get("next_turns"):  # a conversation (a row of one turn carries no count)
            row["turns"] = len(reply.answers)
            if reply.stopped:
                row["stopped"] = reply.stopped
        if "source" in prompt:
            row["source"] = prompt["source"]
        return row

    def progress(split, total, initial):  # its estimate holds from the first it shows (draftlab/progress.py)
        return bar(total, f"synthesize {split}", "row", initial)

    stats = synth.synthesize(splits, backend, out, answers_key(params, inputs), make_row, progress, reuse=True, planned=planned)
    counts = stats["counts"]
    n_in = sum(c["input"] for c in counts.values())
    n_ok = sum(c["ok"] for c in counts.values())
    n_err = len(stats["errors"])
    if n_ok + n_err != n_in:  # every prompt is either answered or listed with its reason
        raise RuntimeError(f"synthesize lost rows: {n_ok} ok + {n_err} errors != {n_in} prompts")
    if n_ok == 0 and n_err:
        raise UserError(f"all {n_err} prompts failed; see {out / 'errors.jsonl'}; first reason: {stats['errors'][0]['error']}")
    info = {
        "backend": synth_params.backend,
        **backend.info,
        "input": n_in,
        "ok": n_ok,
        "errors": n_err,
        "counts": counts,
        "resumed": stats["resumed"],
        "reused": stats["reused"],  # conversations answered by the last finished run (same resume key), not generated again
        "finish_reasons": stats["finish_reasons"],  # of each row's last answer
        "answer_finish_reasons": stats["answer_finish_reasons"],  # of every answer, every turn of every row
        "turns_answered": stats["turns"],  # answers in the outputs, every turn of every row
        "conversations_stopped": stats["stopped"],  # rows ended before their last user turn, by reason
        "completion_tokens": stats["completion_tokens"],  # generated in this run (not the resumed rows)
        "generation_s": round(stats["generation_s"], 3),
        # None when nothing was generated (every row resumed or reused)
        "tokens_per_s": round(stats["completion_tokens"] / stats["generation_s"], 1)
        if stats["generation_s"] > 0 and stats["completion_tokens"] else None,
        "tokenizer_hash": tokenizer_hash(tok),
        "chat_template_hash": chat_template_hash(tok),
        "files": output_files(out),  # per file rows + sha256: extract names the one cut or changed
    }
    if server_startup:  # seconds from launch to healthy, by phase, per server (draftlab.sglang.startup)
        info["server_startup"] = server_startup
    # The outputs' content hash is an input too: sampled answers differ between runs.
    manifest = build_manifest("synthesize", as_dict(params), {**inputs, "outputs_sha256": dir_hash(out)}, __file__, info)
    write_manifest(out, manifest)
    length = stats["answer_finish_reasons"].get("length", 0)
    failed = f"{n_err} failed (reasons in {out / 'errors.jsonl'})" if n_err else "0 failed"
    turns = f" ({stats['turns']} turns)" if stats["turns"] != n_ok else ""
    stopped = f", {stats['stopped']['context']} conversations stopped before a turn that would not fit the context" \
        if stats["stopped"].get("context") else ""
    if stats["stopped"].get("length"):
        stopped += f", {stats['stopped']['length']} conversations ended at a cut answer (synth.after_cut stop)"
    reused = f", {stats['reused']} of them reused from the last run" if stats["reused"] else ""
    print(f"synthesize: {n_ok} answered{turns}{reused}, {failed}, {length} answers cut at synth.max_new_tokens{stopped}, "
          + (f"{info['tokens_per_s']} tokens/s" if info["tokens_per_s"] else "nothing generated") + f" -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, prompts="data/prompts", out="data/synth")
