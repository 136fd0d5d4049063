"""Stage train: fit the EAGLE-3 draft on the standardized features with training-time test.

    python -m stages.train --features data/features --out models/draft-ckpt --reports reports/train
    torchrun --nproc_per_node 2 -m stages.train ...      (data parallel; gloo on CPU, nccl on CUDA)
Reads params sections: target, train.
train.features online (the features' manifest says so too): no stored hidden states; every
process loads the target once on its training device and computes each batch's states
(draftlab.features.online). The training rate (tokens/s) is printed and recorded either way.
Resumable: a checkpoint is written every train.checkpoint_every steps under --resume-dir; a re-run
with the same configuration continues from it and ends with the same weights as an
uninterrupted run. It is deleted once the stage completes. A run of another configuration keeps
it beside as last.<its key>.pt, says what differs, and that configuration resumes from it when run
again; DRAFTLAB_TRAIN_RESUME=across-code goes on from one whose params and inputs are this run's
though the code or the packages changed (recorded as resumed_across_code in the draft's manifest).
DRAFTLAB_TRAIN_PROFILE=N[:COUNT] traces steps N.. of this run (draftlab.train.profile) into
<reports>/step-profile.json: where a step's time goes, on the host and on the GPU (it is no
param: `dvc repro --force train` with it set).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from draftlab import parallel
from draftlab.train import RESUME_DIR, loop as train, saved
from draftlab.cli import run_stage_cli
from draftlab.train.draft import DraftConfig
from draftlab.train.flops import Meter, peak_flops
from draftlab.train.profile import StepProfile, requested as profile_requested
from draftlab.errors import UserError
from draftlab.features.dataset import FeatureDataset, check_manifest_target, load_draft_vocab
from draftlab.fsutil import atomic_replace_dir, atomic_write_json, atomic_write_text
from draftlab.manifest import build_manifest, read_verified, with_lineage, write_manifest
from draftlab.features.online import OnlineFeatures, OnlineTarget, cache_states
from draftlab.params import as_dict, load_params
from draftlab.sglang.layers import ids_for_physical, user_layers_from_physical
from draftlab.target.load import target_fingerprint
from draftlab.target.weights import load_target_head


def physical_layers(train_ds: FeatureDataset, eval_ds: FeatureDataset) -> list[int]:
    """The physical layers the features hold, from the shards (the same in both splits)."""
    if train_ds.physical_layers != eval_ds.physical_layers:
        raise UserError(f"{train_ds.dir} holds physical layers {train_ds.physical_layers} but {eval_ds.dir} holds "
                        f"{eval_ds.physical_layers}; re-run standardize")
    return train_ds.physical_layers


def datasets(features: Path, features_manifest: dict, params):
    """(train, eval) datasets: stored states (FeatureDataset) or, with train.features online, the
    tokens records and one target per process computing the states per batch (OnlineFeatures)."""
    mode = features_manifest["info"].get("mode", "offline")
    if mode != params.train.features:
        raise UserError(f"params.yaml: train.features is {params.train.features!r} but {features} was standardized for "
                        f"{mode!r} (its manifest info.mode); run dvc repro (extract reads train.features), or set "
                        f"train.features: {mode}")
    max_length = params.train.max_length
    if mode == "offline":
        return FeatureDataset(features / "train", max_length), FeatureDataset(features / "eval", max_length)
    extract = load_params(["extract"]).extract  # of it, only engine, tp_size and engine_args: what computes the states online
    if extract.tp_size > 1:  # one target per training process: DDP ranks are not TP groups
        raise UserError(f"params.yaml: extract.tp_size {extract.tp_size} with train.features online: online training "
                        "runs one whole target per process; set train.features offline (extract captures tensor-parallel) "
                        "or extract.tp_size 1")
    batch_tokens = params.train.batch_tokens or params.train.batch_size * max_length  # the most one batch holds
    target = OnlineTarget(params.target, extract, ids_for_physical, batch_tokens)  # the states from extract.engine, as extract's
    return OnlineFeatures(features / "train", max_length, target), OnlineFeatures(features / "eval", max_length, target)


def write_plots(reports: Path, history: list[dict]) -> None:
    """TSV files for `dvc plots` and PNGs for a quick look: loss and per-position acceptance vs epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = reports / "plots"
    K = len(history[0]["eval_accept"])
    lines = ["epoch\ttrain_loss\teval_loss"] + [f"{h['epoch']}\t{h['train_loss']:.6f}\t{h['eval_loss']:.6f}" for h in history]
    atomic_write_text(plots / "loss.tsv", "\n".join(lines) + "\n")
    head = "epoch\t" + "\t".join(f"accept_{i + 1}" for i in range(K)) + "\ttau_pred"
    rows = [f"{h['epoch']}\t" + "\t".join(f"{a:.6f}" for a in h["eval_accept"]) + f"\t{h['eval_tau_pred']:.6f}" for h in history]
    atomic_write_text(plots / "accept.tsv", "\n".join([head] + rows) + "\n")
    # Greedy chains replayed over the eval answers after each epoch, by depth: the first turns are what a
    # bench of first turns serves (the figure a grid ranks by), every turn what training predicts over
    head = "epoch\t" + "\t".join(f"{which}_{n + 1}" for which in ("first_turns", "every_turn") for n in range(K))
    rows = [f"{h['epoch']}\t" + "\t".join(f"{t:.6f}" for t in h["eval_tau_decoded_first_turns_by_steps"] + h["eval_tau_decoded_by_steps"])
            for h in history]
    atomic_write_text(plots / "decoded.tsv", "\n".join([head] + rows) + "\n")
    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(epochs, [h["train_loss"] for h in history], label="train")
    ax.plot(epochs, [h["eval_loss"] for h in history], label="eval")
    ax.set(xlabel="epoch", ylabel="TTT loss", title="draft loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plots / "loss.png", dpi=100)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for i in range(K):
        ax.plot(epochs, [h["eval_accept"][i] for h in history], label=f"a_{i + 1}")
    ax.set(xlabel="epoch", ylabel="conditional acceptance", ylim=(0, 1), title="eval acceptance per draft position")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(plots / "accept.png", dpi=100)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for n in range(K):
        ax.plot(epochs, [h["eval_tau_decoded_first_turns_by_steps"][n] for h in history], label=f"chain of {n + 1}")
    ax.set(xlabel="epoch", ylabel="tau (tokens per round)", title="greedy chains replayed over the eval first turns")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(plots / "decoded.png", dpi=100)
    plt.close("all")


def state_cache_info(train_ds, eval_ds, features: str) -> dict:
    """The train manifest's state_cache (train.state_cache): kept, whether any sequence's states were kept
    after the first epoch (at the end of the run: a cache given back for memory counts as none); bytes, what
    every sequence's states take (0 offline); kept_bytes, what the kept ones take, both tiers; host_bytes,
    those of them in host memory (the tier past the device's budget); kept_sequences, host_sequences (of
    those) and sequences, per split (a partial cache keeps some of them: draftlab.features.online.cache_states)."""
    splits = {"train": train_ds, "eval": eval_ds}
    online = features == "online"
    caches = {name: getattr(ds, "cache", None) if online else None for name, ds in splits.items()}
    kept = {name: 0 if c is None else c.keep for name, c in caches.items()}
    return {"kept": any(kept.values()),
            "bytes": sum(ds.state_bytes() for ds in splits.values()) if online else 0,
            "kept_bytes": sum(c.nbytes() for c in caches.values() if c is not None),
            "host_bytes": sum(c.host_nbytes() for c in caches.values() if c is not None),
            "kept_sequences": kept, "host_sequences": {name: 0 if c is None else c.host_keep for name, c in caches.items()},
            "sequences": {name: len(ds) for name, ds in splits.items()}}


def cuda_memory(device) -> dict | None:
    """This process's peak CUDA memory and how often the caching allocator ran short (a retry frees
    its cached blocks and synchronizes the device: the GPU idles meanwhile); None off a GPU."""
    if device.type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    return {"peak_allocated_gib": round(s.get("allocated_bytes.all.peak", 0) / 2**30, 2),
            "peak_reserved_gib": round(s.get("reserved_bytes.all.peak", 0) / 2**30, 2),
            "alloc_retries": int(s.get("num_alloc_retries", 0)), "ooms": int(s.get("num_ooms", 0))}


def step1_line(kinds: dict, bands: dict, turns: dict | None = None) -> str:
    """The eval split's step-1 acceptance by kind of token, position band and turn, in one line."""
    def rate(c):
        return "-" if c["a_1"] is None else f"{c['a_1']:.3f}"
    total = sum(c["tokens"] for c in kinds.values()) or 1
    line = (f"step-1 acceptance on the eval split: loop tokens {rate(kinds['loop'])} ({kinds['loop']['tokens'] / total:.0%} of "
            f"tokens), other {rate(kinds['other'])}; by answer position " + ", ".join(f"{k} {rate(c)}" for k, c in bands.items()))
    if turns:
        line += "; by turn " + ", ".join(f"{k} {rate(c)} ({c['tokens'] / total:.0%})" for k, c in turns.items())
    return line


RESUME_ENV = "DRAFTLAB_TRAIN_RESUME"


def resume_across_code() -> bool:
    """DRAFTLAB_TRAIN_RESUME=across-code: go on from a checkpoint whose params and inputs are this
    run's though the code or the package versions changed (a fix pulled mid-training); unset: only
    from this very configuration's."""
    value = os.environ.get(RESUME_ENV, "")
    if value not in ("", "across-code"):
        raise UserError(f"{RESUME_ENV}={value!r}: the one value is across-code (resume from a checkpoint of the same "
                        "params and inputs after the code or the packages changed); unset it to resume only the same run")
    return value == "across-code"


def main(features: Path, out: Path, reports: Path, resume_dir: Path) -> None:
    params = load_params(["target", "train"])
    target_params, train_params = params.target, params.train
    profiled = profile_requested()  # a malformed DRAFTLAB_TRAIN_PROFILE stops the stage before any work
    across_code = resume_across_code()
    features_manifest = read_verified(features)  # every shard standardize recorded, complete
    target = (features_manifest.get("info") or {}).get("target")
    if not isinstance(target, dict) or not target:
        raise UserError(f"{features}/manifest.json has no info.target; re-run the standardize stage")
    check_manifest_target(features, target)
    if target.get("model") != target_params.model:
        raise UserError(f"{features} was extracted from target {target.get('model')!r} but target.model is "
                        f"{target_params.model!r}; run dvc repro")
    d2t, t2d = load_draft_vocab(features)
    train_ds, eval_ds = datasets(features, features_manifest, params)
    physical = physical_layers(train_ds, eval_ds)
    embed, head = load_target_head(target_params.model, target_params.revision)
    if tuple(head.shape) != (target["vocab_size"], target["hidden_size"]):
        raise UserError(f"target lm_head is {list(head.shape)} but the features say vocab {target['vocab_size']} x hidden {target['hidden_size']}")
    cfg = DraftConfig.from_target(target, len(physical), len(d2t), train_params.intermediate_size)
    if train_params.ttt_steps < 1:
        raise UserError(f"train.ttt_steps must be >= 1, got {train_params.ttt_steps}")

    device = train.resolve_device(train_params.device)
    rank, world = parallel.setup_distributed(device.type)
    if train_params.features == "online":
        train_ds.target.load(device)  # its weights on the device before the state cache is sized
        decided = cache_states([train_ds, eval_ds], train_params.state_cache, device, world)
        if rank == 0:
            print(decided)
    inputs = {"features": features_manifest["config_hash"], "target": target_fingerprint(target_params)}
    manifest = build_manifest("train", as_dict(params), inputs, __file__)
    draft = train.init_draft(cfg, embed, head, d2t, t2d, train_params.seed)
    meter = Meter(target, cfg, train_params.features == "online")
    traced = StepProfile(*profiled, device, reports / "step-profile.json") if profiled and rank == 0 else None
    if traced:
        traced.step(0)

    def on_step(step, _loss, sec):
        if traced:
            traced.step(step)

    notes = {}
    history = train.fit(draft, head.float(), train_ds, eval_ds, train_params, resume_dir / "last.pt", manifest["config_hash"],
                        device, rank, world, on_step=on_step if traced else None, meter=meter,
                        identity={k: manifest[k] for k in ("params", "inputs", "code", "packages")},
                        across_code=across_code, notes=notes)
    # Every figure covers the whole training, the runs a resume went on from included (their counters
    # are in the checkpoint); rate["from_step"] > 0 where a checkpoint held none. Training rate: real
    # tokens of every process's steps over this process's optimizer-step time (batch making, the
    # target's forward when online, draft forward/backward; no eval, no state cache refill).
    seconds = meter.wall_s()
    rate = meter.summary(peak_flops(device))
    tokens, tokens_per_s = rate["tokens"], rate["tokens_per_s"]
    if rank == 0:
        last = history[-1]
        tmp = out.with_name(f".{out.name}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        saved.save_draft(tmp, draft)
        # No physical layers here: they are the features' (manifest inputs.features names the run).
        manifest["info"] = {"draft": cfg.to_dict(), "history": history,
                            "seconds": round(seconds, 1), "processes": world, "device": str(device),
                            "train_sequences": len(train_ds), "eval_sequences": len(eval_ds),
                            "features": train_params.features, "train_tokens": tokens, "tokens_per_s": tokens_per_s,
                            "throughput": rate,  # draftlab.train.flops: FLOPs of the target and the draft, MFU, padding
                            # online: the target's states are computed per batch; none are stored or read
                            "hidden_bytes_written": 0,
                            "state_cache": state_cache_info(train_ds, eval_ds, train_params.features),
                            # DRAFTLAB_TRAIN_RESUME=across-code: the step it went on from, and what had changed
                            "resumed_across_code": notes.get("resumed_across_code"),
                            "cuda_memory": cuda_memory(device)}
        write_manifest(tmp, manifest)
        atomic_replace_dir(tmp, out)
        K = train_params.ttt_steps
        metrics = {
            "tau_pred": last["eval_tau_pred"],
            "eval_loss": last["eval_loss"],
            "train_loss": last["train_loss"],
            "accept": {f"step_{i + 1}": last["eval_accept"][i] for i in range(K)},
            "top1_acc": {f"step_{i + 1}": last["eval_top1_acc"][i] for i in range(K)},
            "tau_by_steps": {f"steps_{n + 1}": last["eval_tau_by_steps"][n] for n in range(K)},
            # greedy chain decoding replayed over the eval answers (draftlab.train.evaluate.decoded_rounds): each round
            # starts where the last stopped, so the rows scored are those decoding would score
            "tau_decoded_by_steps": {f"steps_{n + 1}": last["eval_tau_decoded_by_steps"][n] for n in range(K)},
            # the same over each eval conversation's first answer alone: what a bench of first turns serves
            "tau_decoded_first_turns_by_steps": {f"steps_{n + 1}": last["eval_tau_decoded_first_turns_by_steps"][n]
                                                 for n in range(K)},
            # the first draft token's hit rate on the eval split, split by the predicted token: a loop token of its
            # answer (an 8-gram repeated within it) or not, and its position band in the answer
            "step1_by_kind": last.get("eval_step1_by_kind"),
            "step1_by_position": last.get("eval_step1_by_position"),
            "step1_by_turn": last.get("eval_step1_by_turn"),  # the predicted token's answer: turn 1, 2, 3 and later
            "epochs": last["epoch"],
            "optimizer_steps": last["step"],
            "seconds": round(seconds, 1),
            "tokens_per_s": tokens_per_s,  # training tokens/s of the optimizer steps (eval excluded)
            "padding_share": last["train_padding_share"],  # padded / all tokens of the last epoch's steps
            "target_flops_per_s": rate["target_flops_per_s"],  # online: the target's forward; both: the soft labels' head
            "draft_flops_per_s": rate["draft_flops_per_s"],  # the TTT steps, forward + backward
            "mfu": rate["mfu"],  # counted FLOPs / time / peak bf16 FLOP/s of the GPU; null on a CPU
        }
        settings = {"target_model": target_params.model, "target_revision": target_params.revision,
                    "capture_layers": user_layers_from_physical(physical), "physical_layers": physical,
                    "ttt_steps": K, "ttt_decay": train_params.ttt_decay, "draft_vocab_size": cfg.draft_vocab_size,
                    "epochs": train_params.epochs, "batch_size": train_params.batch_size, "lr": train_params.lr,
                    "features": train_params.features, "batch_tokens": train_params.batch_tokens}
        atomic_write_json(reports / "metrics.json", with_lineage(metrics, manifest, settings))
        write_plots(reports, history)
        (resume_dir / "last.pt").unlink(missing_ok=True)
        print(f"train: tau_pred {last['eval_tau_pred']:.3f} over {K} steps, accept {[round(a, 3) for a in last['eval_accept']]}, "
              f"{seconds:.0f}s -> {out}")
        print(f"train: tau decoded over the eval answers (rounds replayed) by depth: "
              f"{[round(t, 3) for t in last['eval_tau_decoded_by_steps']]}; over first turns only: "
              f"{[round(t, 3) for t in last['eval_tau_decoded_first_turns_by_steps']]}")
        if kinds := last.get("eval_step1_by_kind"):
            print(f"train: {step1_line(kinds, last['eval_step1_by_position'], last.get('eval_step1_by_turn'))}")
        print(f"train: features {train_params.features}: {tokens} training tokens at {tokens_per_s} tokens/s "
              f"(optimizer steps only{', target forward included' if train_params.features == 'online' else ''})")
        flop_s = "FLOPs not counted (the target's facts lack a size)" if rate["target_flops_per_s"] is None else (
            f"{rate['target_flops_per_s'] / 1e12:.2f} TFLOP/s target + {rate['draft_flops_per_s'] / 1e12:.2f} draft "
            f"({rate['target_flop_share']:.0%} target), MFU {'n/a (no peak for this device)' if rate['mfu'] is None else format(rate['mfu'], '.1%')}")
        print(f"train: padding {last['train_padding_share']:.1%} of the last epoch's tokens; {flop_s}")
        if by := rate.get("by_states"):
            print(f"train: steps whose states the target computed: {by['computed']['steps']} at {by['computed']['tokens_per_s']} "
                  f"tokens/s; read from the state cache: {by['cached']['steps']} at {by['cached']['tokens_per_s']} tokens/s")
        if traced and traced.close():
            print(traced.line())
        elif traced:
            print(f"train: nothing traced: step {traced.first} is not among the steps this process ran (the run ends at step "
                  f"{history[-1]['step']}; a resumed run starts after its checkpoint). DRAFTLAB_TRAIN_PROFILE counts steps "
                  "from 1 over all epochs")
        if (mem := manifest["info"]["cuda_memory"]) and mem["alloc_retries"]:
            print(f"train: warning: the CUDA allocator ran short {mem['alloc_retries']} time(s) (peak {mem['peak_reserved_gib']} GiB "
                  "reserved): each time it freed its cache and synchronized the GPU, which slows the steps; train.state_cache off "
                  "or a smaller train.batch_tokens leaves it more room, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True less "
                  "fragmentation")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run_stage_cli(main, __doc__, features="data/features", out="models/draft-ckpt", reports="reports/train", resume_dir=RESUME_DIR)
