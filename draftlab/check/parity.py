"""Live parity: replay training sequences through the serving capture path and compare hidden states.

For N training sequences (spread over the train split's shards), the `input_ids` go to a
capture source that returns, per prompt token, the k*H aux concatenation the server feeds the
draft; each of the k slots is compared with the stored features of the same tokens (per slot:
max abs difference, relative error ||live - stored|| / ||stored||, mean cosine, norm ratio).
Each live slot is also matched against every reference state at hand (the stored slots, the
stored post-norm final state, and when the target is loaded here every physical layer, the
embedding output, physical 0, included), which names what the server really captures: a draft
trained on the embedding output is checked like any other layer.

Capture sources:
  http_capture(url)            any SGLang EAGLE3 server started with --enable-return-hidden-states,
                               or the project's reference server (same JSON shape)
  inprocess_capture(model, p)  the reference engine's own capture path (extract.AuxCapture)
                               at physical layers p: what the exported config makes SGLang capture

    python -m draftlab.check parity --url http://127.0.0.1:30000 --features data/features
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from draftlab.check.findings import Finding, error, info, warning
from draftlab.errors import UserError
from draftlab.features.extract import decoder_layers
from draftlab.features.dataset import norm_summary, read_metadata

COSINE_SAME_DIRECTION = 0.99  # mean per-token cosine above which two states differ only in scale/precision


@dataclass
class StoredSequence:
    row_id: object  # the synthesized row's id (shard metadata row_ids), or "shard:index" when absent
    input_ids: list[int]
    aux: torch.Tensor  # [T, k*H] float32, in the features' stored slot order
    final: torch.Tensor  # [T, H] float32: the target's final state after the norm (physical L)


def stored_sequences(features: str | Path, n: int, split: str = "train") -> tuple[list[StoredSequence], dict]:
    """`n` sequences spread evenly over the split's shards, and the first shard's metadata."""
    paths = sorted((Path(features) / split).glob("shard-*.safetensors"))
    if not paths:
        raise UserError(f"{Path(features) / split}: no feature shards; run the standardize stage")
    meta = read_metadata(paths[0])
    index = []  # (path, start, end, row id)
    for path in paths:
        rows = read_metadata(path).get("row_ids")
        with safe_open(str(path), "pt") as f:
            off = f.get_tensor("seq_offsets").tolist()
        index += [(path, a, b, rows[s] if rows and s < len(rows) else f"{path.name}:{s}")
                  for s, (a, b) in enumerate(zip(off[:-1], off[1:])) if b > a]
    picks = sorted({round(i * (len(index) - 1) / max(1, n - 1)) for i in range(min(n, len(index)))})
    out = []
    for i in picks:
        path, a, b, row = index[i]
        with safe_open(str(path), "pt") as f:
            out.append(StoredSequence(row, f.get_slice("input_ids")[a:b].tolist(), f.get_slice("aux_hidden")[a:b].float(),
                                      f.get_slice("final_hidden")[a:b].float()))
    return out, meta


def _depth(x) -> int:
    d = 0
    while isinstance(x, list) and x:
        x, d = x[0], d + 1
    return d


def hidden_rows(raw, hidden_size: int) -> torch.Tensor:
    """meta_info["hidden_states"] -> [rows, width] float32.

    Accepts a flat [T][k*H] list, a [T][k][H] nesting, and SGLang's shape: the prompt's block
    [T][D] first, then one [D] row per generated token.
    """
    if _depth(raw) == 2:
        return torch.tensor(raw, dtype=torch.float32)
    if _depth(raw) == 3 and all(_depth(t) == 2 and len(t[0]) == hidden_size for t in raw):  # [T][k][H]
        return torch.tensor([[x for layer in tok for x in layer] for tok in raw], dtype=torch.float32)
    rows = []
    for item in raw:
        if _depth(item) == 1:
            rows.append(item)
        elif _depth(item) == 2:
            rows.extend(item)
        else:
            raise ValueError(f"hidden_states item of nesting depth {_depth(item)}")
    return torch.tensor(rows, dtype=torch.float32)


def prompt_rows(meta: dict, num_prompt_tokens: int, hidden_size: int) -> tuple[torch.Tensor, int]:
    """(rows, first position) of the prompt's hidden states in a /generate meta_info.

    SGLang returns rows only for the prompt tokens it computed: with its radix (prefix) cache on,
    the first `cached_tokens` positions came from the cache and have no row (measured on SGLang
    0.5.14: a 12-token prompt with cached_tokens 3 gave 9 prompt rows, for positions 3..11).
    """
    start = int(meta.get("cached_tokens") or 0)
    rows = hidden_rows(meta["hidden_states"], hidden_size)
    return rows[:max(0, num_prompt_tokens - start)], start


def http_capture(url: str, hidden_size: int, timeout_s: float = 120.0) -> Callable[[list[int]], tuple[torch.Tensor, int]]:
    """A capture source that asks a server's /generate for the hidden states of `input_ids`:
    returns (rows, position of the first row), see prompt_rows."""
    from draftlab.sglang.client import Client

    def capture(ids: list[int]) -> tuple[torch.Tensor, int]:
        # 2 new tokens, not 1: one verify step runs, so a speculating server's per-request counters
        # stay finite (with 1, spec_verify_ct is 0). Only the prompt's rows are compared.
        with Client(url, timeout_s) as client:
            _, meta = client.generate(ids, {"max_new_tokens": 2, "temperature": 0}, return_hidden_states=True)
        if not meta.raw.get("hidden_states"):
            raise UserError(f"{url}/generate returned no meta_info.hidden_states; start the server with --enable-return-hidden-states")
        return prompt_rows(meta.raw, len(ids), hidden_size)

    return capture


def inprocess_capture(model, physical: list[int]) -> Callable[[list[int]], tuple[torch.Tensor, int]]:
    """The reference engine's capture path: AuxCapture hooks at `physical` (ascending concatenation).
    Returns (rows, 0): every prompt position, like a server with nothing cached."""
    from draftlab.features.extract import AuxCapture

    base, _, _ = decoder_layers(model)
    device = next(model.parameters()).device

    @torch.no_grad()  # not inference_mode: callers may edit the result in place
    def capture(ids: list[int]) -> tuple[torch.Tensor, int]:
        with AuxCapture(model, physical) as cap:
            base(input_ids=torch.tensor([ids], device=device), use_cache=False)
            return cap.take()[0].float().cpu(), 0

    return capture


def reference_states(model) -> Callable[[list[int]], dict[str, torch.Tensor]]:
    """Every physical layer of a local target for `ids`: {"physical i": [T, H]} and "final" (post-norm)."""
    base, layers, _ = decoder_layers(model)
    L, device = len(layers), next(model.parameters()).device

    @torch.no_grad()  # not inference_mode: callers may edit the result in place
    def states(ids: list[int]) -> dict[str, torch.Tensor]:
        hs = base(input_ids=torch.tensor([ids], device=device), use_cache=False, output_hidden_states=True).hidden_states
        return {**{f"physical {i}": hs[i][0].float().cpu() for i in range(L)}, "final": hs[L][0].float().cpu()}

    return states


def run_parity(seqs: list[StoredSequence], meta: dict, capture: Callable, source: str,
               reference: Callable | None = None, live_physical: list[int] | None = None) -> dict:
    """Compare live captures with stored features, slot by slot; a JSON-able result (see check_live_capture)."""
    trained, H = list(meta["physical_layers"]), int(meta["hidden_size"])
    k = len(trained)
    result = {"source": source, "trained_physical": trained, "live_physical": live_physical, "sequences": [s.row_id for s in seqs],
              "tokens": 0, "slots": [], "error": None}
    acc = [{"d2": 0.0, "s2": 0.0, "max": 0.0, "cos": [], "live": [], "stored": [], "cand": {}} for _ in range(k)]
    for seq in seqs:
        try:
            live, start = capture(seq.input_ids)  # rows from prompt position `start` (a server's prefix cache)
        except (UserError, ValueError) as e:
            result["error"] = {"kind": "unreachable", "message": str(e)}
            return result
        if live.shape[-1] != k * H:
            result["error"] = {"kind": "width", "message": f"the live capture is {live.shape[-1]} wide, the features {k} x {H} = {k * H}",
                               "live_width": int(live.shape[-1]), "stored_width": k * H}
            return result
        T = min(len(live), len(seq.input_ids) - start)
        if T <= 0:
            continue
        window = slice(start, start + T)
        stored = seq.aux[window]
        cands = {f"physical {p}": stored[:, j * H:(j + 1) * H] for j, p in enumerate(trained)}
        cands["final"] = seq.final[window]
        if reference is not None:
            cands.update({name: t[window] for name, t in reference(seq.input_ids).items()})
        result["tokens"] += T
        result["cached_tokens"] = result.get("cached_tokens", 0) + start
        for j, a in enumerate(acc):
            lv, st = live[:T, j * H:(j + 1) * H], stored[:, j * H:(j + 1) * H]
            a["d2"] += (lv - st).pow(2).sum().item()
            a["s2"] += st.pow(2).sum().item()
            a["max"] = max(a["max"], (lv - st).abs().max().item())
            a["cos"].append(torch.nn.functional.cosine_similarity(lv, st, dim=-1))
            a["live"].append(lv.norm(dim=-1))
            a["stored"].append(st.norm(dim=-1))
            for name, c in cands.items():
                d2, c2 = a["cand"].get(name, (0.0, 0.0))
                a["cand"][name] = (d2 + (lv - c).pow(2).sum().item(), c2 + c.pow(2).sum().item())
    for j, a in enumerate(acc):
        if not a["live"]:
            break
        live_n, stored_n = torch.cat(a["live"]), torch.cat(a["stored"])
        cand = {name: (d2 / c2) ** 0.5 if c2 else float("inf") for name, (d2, c2) in a["cand"].items()}
        best = min(cand, key=cand.get)
        result["slots"].append({
            "slot": j, "trained_physical": trained[j], "live_physical": live_physical[j] if live_physical and j < len(live_physical) else None,
            "rel_err": (a["d2"] / a["s2"]) ** 0.5 if a["s2"] else float("inf"), "max_abs_diff": a["max"],
            "cos": torch.cat(a["cos"]).mean().item(), "norm_ratio": live_n.mean().item() / max(stored_n.mean().item(), 1e-30),
            "live_norm": norm_summary(live_n), "stored_norm": norm_summary(stored_n),
            "best_match": best, "best_rel_err": cand[best], "candidates": cand,
        })
    return result


# ---------------------------------------------------------------------------------------------
# Fault 6: what the live capture says


def _stats_match(live_mean: float, train_norms: dict) -> tuple[str | None, float | None]:
    """The stats.json entry ("2", "final", ...) whose mean norm is nearest to `live_mean` (log scale)."""
    import math

    means = {k: v["mean"] for k, v in (train_norms or {}).items() if isinstance(v, dict) and v.get("mean")}
    if not means or live_mean <= 0:
        return None, None
    best = min(means, key=lambda k: abs(math.log(live_mean / means[k])))
    return best, live_mean / means[best]


def _ref_name(key: str | None) -> str | None:
    """stats.json key -> reference name: "4" -> "physical 4", "final" stays."""
    return None if key is None else (key if key == "final" else f"physical {key}")


def classify_slot(slot: dict, train_norms: dict, rtol: float, norm_tolerance: float) -> tuple[str, dict] | None:
    """(finding name, evidence) for one live slot, or None when it matches the training layer."""
    p = slot["trained_physical"]
    own = (train_norms or {}).get(str(p)) or {}
    stats_ratio = slot["live_norm"]["mean"] / own["mean"] if own.get("mean") else None
    ev = {"slot": slot["slot"], "trained_physical": p, "live_physical": slot.get("live_physical"),
          "rel_err": round(slot["rel_err"], 4), "max_abs_diff": round(slot["max_abs_diff"], 4), "cos": round(slot["cos"], 4),
          "norm_ratio": round(slot["norm_ratio"], 4), "norm_ratio_vs_stats": None if stats_ratio is None else round(stats_ratio, 4),
          "best_match": slot["best_match"], "best_rel_err": round(slot["best_rel_err"], 4)}
    if slot["rel_err"] <= rtol:
        return None
    if slot["best_rel_err"] <= rtol:  # the live slot IS one of the reference states, token for token
        ev["basis"] = "per-token comparison"
        if slot["best_match"] == "final":
            return "final_norm_applied", ev
        if slot["best_match"] != f"physical {p}":
            return "layer_shift", {**ev, "matches_physical": int(slot["best_match"].split()[1])}
    elif stats_ratio is not None and abs(stats_ratio - 1) > norm_tolerance:
        # No exact match at hand: the training norm statistics say which layer it resembles.
        key, ratio = _stats_match(slot["live_norm"]["mean"], train_norms)
        if key is not None and abs(ratio - 1) <= norm_tolerance and key != str(p):
            ev.update(basis="norm statistics", nearest_stats_layer=_ref_name(key), norm_ratio_vs_nearest=round(ratio, 4))
            return ("final_norm_applied" if key == "final" else "layer_shift"), ev
    if slot["cos"] >= COSINE_SAME_DIRECTION:
        return ("hidden_norm_mismatch" if abs(slot["norm_ratio"] - 1) > rtol else "hidden_precision_mismatch"), ev
    return "live_hidden_mismatch", ev


CAUSES = {
    "layer_shift": ("the serving capture feeds other layers than the draft was trained on (slots list the physical layer each one "
                    "really matches): the exported ids or the serving SGLang's layer rule differ from extraction",
                    "set eagle_config.eagle_aux_hidden_state_layer_ids to the ids for the trained layers (see capture findings)"),
    "feature_order_wrong": ("the server feeds the trained layers, but the features hold them in another slot order; SGLang "
                            "concatenates in ascending layer order", "re-run standardize, train and export"),
    "final_norm_applied": ("the live state equals the target's final state AFTER the norm: one side applies the final norm "
                           "(a post-norm capture such as hidden_states[-1]) where the other takes the pre-norm residual stream",
                           "capture pre-norm residual streams on both sides (physical 0..L-1: the embedding output and "
                           "the decoder layers' outputs)"),
    "hidden_norm_mismatch": ("the live layer points the same way as the trained one but its norm differs: a dtype or "
                             "normalisation difference (features scaled or normalised at extraction, fp16 overflow, another dtype)",
                             "extract features exactly as the server computes them; compare the dtype of extract and serving"),
    "hidden_precision_mismatch": ("the right layer, but further from the features than parity_rtol: the server runs in a "
                                  "lower precision than extraction (bf16/fp16/fp8 vs fp32)",
                                  "extract in the serving dtype, or raise check.parity_rtol if this precision is intended"),
    "live_hidden_mismatch": ("the live capture matches no layer the features hold: another target checkpoint or revision, "
                             "or a capture path this check does not know", "serve exactly the target the features were extracted from"),
}
SEVERITY = {"hidden_precision_mismatch": warning}


def check_live_capture(parity: dict | None, train_norms: dict | None, rtol: float, norm_tolerance: float) -> list[Finding]:
    """Fault 6: live capture vs training features (per token) and vs data/features/stats.json norms."""
    if parity is None:
        return []
    where = {"source": parity["source"], "sequences": parity["sequences"], "tokens": parity["tokens"]}
    err = parity.get("error")
    if err and err["kind"] == "width":
        return [error("live_width_mismatch", {**where, **err},
                      "the serving capture feeds a different number of layers than the draft was trained on; its fc cannot read it",
                      "see the capture findings (dropped ids, missing eagle_config)")]
    if err:  # asked for and not obtained (a server unreachable or not returning hidden states): the check cannot pass
        return [error("live_parity_failed", {**where, **err}, f"live parity could not run against {parity['source']}: "
                      f"{err.get('message')}; the live capture is unproven",
                      "start the server with --enable-return-hidden-states, or set check.server_url: \"\" for the in-process check, "
                      "or check.live_parity_samples: 0 to skip live parity")]
    found: dict[str, list[dict]] = {}
    for slot in parity["slots"]:
        hit = classify_slot(slot, train_norms or {}, rtol, norm_tolerance)
        if hit:
            found.setdefault(hit[0], []).append(hit[1])
    shifted = [s for s in found.get("layer_shift", []) if "matches_physical" in s]
    # Slots that swapped places with each other: the features' order, not the server's layers.
    if shifted and len(shifted) == len(found["layer_shift"]) and \
            sorted(s["matches_physical"] for s in shifted) == sorted(s["trained_physical"] for s in shifted):
        found["feature_order_wrong"] = found.pop("layer_shift")
    out = []
    for name, slots in found.items():
        cause, fix = CAUSES[name]
        out.append(SEVERITY.get(name, error)(name, {**where, "slots": slots}, cause, fix))
    if not out:
        worst = max((s["rel_err"] for s in parity["slots"]), default=None)
        out.append(info("live_parity_ok", {**where, "max_rel_err": worst, "rtol": rtol},
                        "the serving capture path feeds the draft the layers it was trained on"))
    return out
