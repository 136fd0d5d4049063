"""Stage self_prompts: the target writes user turns itself, from its chat template's user prefix.

    python -m stages.self_prompts --out data/self-prompts
Reads params: the self_prompts section; target (the model that writes); synth.backend and the keys of
its engine (synth.base_url, synth.timeout_s, synth.server_args, synth.servers_per_gpu,
synth.mem_fraction_static, synth.startup_timeout_s): self prompts are written by the engine that
answers them.

Writes data/self-prompts/prompts.jsonl ({"messages": [{"role": "user", ...}], "source": "self"} per
kept turn, in the order written) and manifest.json (what was left out, tokens and time). With
self_prompts.count 0 (the default) the file is empty and nothing is loaded. The prompts stage adds
the rows to the train split (draftlab/data/self_prompts.py has the method and what is left out).

Reuse: the file of the last finished run is kept while the settings that shape it (the
self_prompts section and the target's pin) are the same and the file is as written, so a change to
how the engine runs (server flags, the number of servers) writes nothing again. Interrupted? Run it
again: it writes them anew.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from pathlib import Path

from draftlab import jsonl
from draftlab.cli import run_stage_cli
from draftlab.data import self_prompts
from draftlab.fsutil import atomic_write_json, canonical_json
from draftlab.manifest import MANIFEST, build_manifest, dir_hash, output_files, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.progress import bar

FILE, KEY_FILE = self_prompts.FILE, self_prompts.KEY_FILE
ENGINE_KEYS = ("backend", "base_url", "timeout_s", "server_args", "servers_per_gpu", "mem_fraction_static", "startup_timeout_s")


def written_key(params) -> str:
    """What the file depends on: the self_prompts section, the target (not the engine's flags) and what is left
    out as an answer (a file written before that rule changed is written again)."""
    from draftlab.target.load import target_fingerprint

    shaped = {"self_prompts": dataclasses.asdict(params.self_prompts), "target": target_fingerprint(params.target),
              "left_out_as_answer": self_prompts.REASONING_MARKUP}
    return hashlib.sha256(canonical_json(shaped).encode()).hexdigest()


def write(params, out: Path) -> tuple[self_prompts.Written, dict]:
    """The target writes self_prompts.count user turns with synth.backend's engine; (what it wrote, info)."""
    sp, synth = params.self_prompts, params.synth
    started, info = time.perf_counter(), {"backend": synth.backend}
    with bar(sp.count, "self_prompts", "turn", 0) as progress:
        if synth.backend == "hf":
            from draftlab.parallel import resolve_device
            from draftlab.target.load import load_target

            device = resolve_device(params.target.device)
            model, tok = load_target(params.target, device)
            got = self_prompts.write_hf(model, tok, sp, device, progress.update)
        else:
            from draftlab.sglang.target_servers import own_servers
            from draftlab.target.load import load_tokenizer

            tok = load_tokenizer(params.target.model, params.target.revision)
            startups: list = []
            own = own_servers(params.target, synth, out, startups, stage="self_prompts") if synth.backend == "sglang" \
                else contextlib.nullcontext([synth.base_url])
            with own as urls:
                native = [u.rstrip("/").removesuffix("/v1") for u in urls]  # SGLang's /generate is beside /v1
                got = self_prompts.write_http(native, tok, sp, synth.timeout_s, progress.update)
            if startups:
                info["server_startup"] = startups
    seconds = time.perf_counter() - started
    return got, info | {"generation_s": round(seconds, 3), "completion_tokens": got.completion_tokens,
                        "tokens_per_s": round(got.completion_tokens / seconds, 1) if seconds > 0 else None}


def main(out: Path) -> None:
    params = load_params(["self_prompts", "target", "synth"])
    sp = params.self_prompts
    out.mkdir(parents=True, exist_ok=True)
    key = written_key(params) if sp.count else None
    (out / MANIFEST).unlink(missing_ok=True)  # a manifest vouches for complete outputs only
    earlier = _read_key(out / KEY_FILE)
    if sp.count and earlier.get("key") == key and (out / FILE).exists() and earlier.get("sha256") == dir_hash(out / FILE):
        info, kept = earlier["info"], "kept from the last run (same self_prompts settings and target)"
    else:
        (out / KEY_FILE).unlink(missing_ok=True)
        got, info = write(params, out) if sp.count else (self_prompts.Written(), {})
        jsonl.write(out / FILE, self_prompts.rows(got.texts))
        info |= {"count": sp.count, "written": len(got.texts), "left_out": got.left_out}
        if sp.count:
            atomic_write_json(out / KEY_FILE, {"key": key, "sha256": dir_hash(out / FILE), "info": info})
        kept = "written"
    used = as_dict(params)
    used["synth"] = {k: getattr(params.synth, k) for k in ENGINE_KEYS}  # the keys dvc.yaml lists
    info = info | {"files": output_files(out)}  # rows + sha256: the prompts stage names a file cut or changed
    write_manifest(out, build_manifest("self_prompts", used, {"outputs_sha256": dir_hash(out)}, __file__, info))
    if not sp.count:
        print(f"self_prompts: self_prompts.count is 0: none written -> {out / FILE}")
        return
    left = info["left_out"]
    as_answer = left["as_answer"]
    print(f"self_prompts: {info['written']} of {sp.count} user turns {kept} ({left['cut']} cut at "
          f"self_prompts.max_new_tokens, {left['empty']} empty, {as_answer} written as an answer, left out) -> {out / FILE}")
    if as_answer > sp.count / 2:
        print(f"self_prompts: warning: {as_answer} of {sp.count} turns hold the target's reasoning markup: asked for a "
              "user's turn, this target writes its own answers. It was not trained to write user turns (an instruct "
              "model tuned on whole conversations is); more of these prompts add little (set self_prompts.count: 0)")


def _read_key(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) and isinstance(got.get("info"), dict) else {}


if __name__ == "__main__":
    run_stage_cli(main, __doc__, out="data/self-prompts")
