"""The wiring check names each train-vs-serve fault injected into the real outputs of a micro pipeline."""
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from draftlab.check import diagnose as check_run
from draftlab.check import __main__
from draftlab.check.draft import check_capture, served_layers
from draftlab.check.findings import names
from draftlab.check.parity import check_live_capture, hidden_rows, inprocess_capture
from draftlab.check.serving import check_tau
from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.errors import UserError
from draftlab.sglang.checkpoint import ExportedDraft, export_sglang
from draftlab.features.extract import capture, render
from draftlab.check.faults import FAULTS, miswire
from draftlab.features.dataset import (build_draft_vocab, count_tokens, load_draft_vocab, norm_summary, pack_sequences, read_metadata,
                               save_draft_vocab, write_shard)
from draftlab.manifest import build_manifest, with_lineage, write_manifest
from tests.support.micro import save_micro_model
from draftlab.params import CheckParams, TargetParams
from draftlab.sglang.flags import SpecFlags, resolve
from draftlab.target.load import chat_template_hash, load_tokenizer, target_info, tokenizer_hash

L, H, V, VD = 8, 64, 256, 64
PHYSICAL = [2, 4, 6]  # capture.layers [1, 3, 5]: SGLang 0.5.14 ids [1, 3, 5] on Llama
CHECK = CheckParams(tau_tolerance=0.10, fail_on_error=True, live_parity_samples=3, parity_rtol=0.05, norm_tolerance=0.15,
                    server_url="", serve_parity=False, request_timeout_s=30.0)
FLAGS = {"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "num_draft_tokens": 4, "max_running_requests": 48,
         "page_size": None, "attention_backend": None}
CHATS = [("Sort: 3 1 2", "<think>small first</think>1 2 3"), ("Reverse 'abc'", "<think>read backwards</think>cba"),
         ("Add 12 and 30", "<think>12 + 30</think>42"), ("Count the a's in banana", "<think>b-a-n-a-n-a</think>3"),
         ("Sort: 9 7 8 1", "<think>compare pairs</think>1 7 8 9"), ("Echo hello", "<think>repeat it</think>hello")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Real outputs of a micro pipeline: synth/hidden/features manifests, features, train metrics, export, bench."""
    root = tmp_path_factory.mktemp("run")
    model = save_micro_model(root / "target", num_layers=L, hidden_size=H, vocab_size=V, max_position_embeddings=512, seed=0)
    tok = load_tokenizer(str(root / "target"))
    target = target_info(model, TargetParams(str(root / "target"), None, "float32", "cpu"))  # as in the features manifest
    hashes = {"chat_template_sha256": chat_template_hash(tok), "tokenizer_sha256": tokenizer_hash(tok)}
    seqs, norms = [], {str(p): [] for p in PHYSICAL} | {"final": []}
    for q, a in CHATS:
        ids, mask = render(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        ids_t = torch.tensor([ids])
        aux, final = capture(model, ids_t, torch.ones_like(ids_t), PHYSICAL)
        seqs.append({"input_ids": ids_t[0], "loss_mask": torch.tensor(mask), "final_hidden": final[0].bfloat16(),
                     "aux_hidden": torch.cat([aux[p][0] for p in PHYSICAL], -1).bfloat16()})
        for p in PHYSICAL:
            norms[str(p)].append(aux[p][0].bfloat16().float().norm(dim=-1))
        norms["final"].append(final[0].bfloat16().float().norm(dim=-1))
    meta = {"physical_layers": PHYSICAL, "hidden_size": H, "num_layers": L, "architecture": "LlamaForCausalLM", "vocab_size": V}
    feat = root / "data/features"
    write_shard(feat / "train/shard-00000.safetensors", pack_sequences(seqs[:3]), {**meta, "row_ids": ["r0", "r1", "r2"]})
    write_shard(feat / "train/shard-00001.safetensors", pack_sequences(seqs[3:]), {**meta, "row_ids": ["r3", "r4", "r5"]})
    counts = sum(count_tokens(s["input_ids"], s["loss_mask"], V) for s in seqs)
    d2t, t2d = build_draft_vocab(counts, VD)
    save_draft_vocab(feat / "draft_vocab.safetensors", d2t, t2d)
    stats = {"norms": {k: norm_summary(torch.cat(v)) for k, v in norms.items()}}  # the exact stats.json format
    (feat / "stats.json").write_text(json.dumps(stats))

    synth = build_manifest("synthesize", {}, {}, info={"backend": "hf", "ok": len(CHATS), "errors": 0,
                                                       "tokenizer_hash": hashes["tokenizer_sha256"], "chat_template_hash": hashes["chat_template_sha256"]})
    write_manifest(root / "data/synth", synth)
    # The extract manifest is the one manifest recording the physical layers; the features hold them in their shards.
    hidden = build_manifest("extract", {}, {"synth": synth["config_hash"]}, info={"target": {**target, "physical_layers": PHYSICAL}, **hashes})
    write_manifest(root / "data/hidden", hidden)
    features = build_manifest("standardize", {}, {"extract": hidden["config_hash"]}, info={"target": target, **hashes, **stats})
    write_manifest(feat, features)
    train = build_manifest("train", {}, {"features": features["config_hash"]})
    metrics = {"tau_pred": 2.1, "tau_by_steps": {"steps_1": 1.6, "steps_2": 1.9, "steps_3": 2.0, "steps_4": 2.1},
               "accept": {"step_1": 0.6, "step_2": 0.5, "step_3": 0.4, "step_4": 0.3}, "eval_loss": 2.0, "epochs": 3}
    (root / "reports/train").mkdir(parents=True)
    (root / "reports/train/metrics.json").write_text(json.dumps(with_lineage(metrics, train, {})))

    draft = Eagle3Draft(DraftConfig.from_target(target, len(PHYSICAL), VD), embed_weight=model.get_input_embeddings().weight.detach())
    draft.set_vocab(d2t, t2d)
    config = export_sglang(draft, root / "models/draft", target, PHYSICAL, "0.5.14")
    write_manifest(root / "models/draft", build_manifest("export", {"export": {"sglang_version": "0.5.14"}},
                                                        {"train": train["config_hash"], "features": features["config_hash"]}, info={"config": config}))
    bench = {"config_hash": "b" * 64, "backend": "reference", "sglang_version": "0.5.14", "draft_dir": "models/draft",
             "target": {k: target[k] for k in ("model", "revision", "architecture", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings")},
             "flags": {"requested": dict(FLAGS), "effective": dict(FLAGS), "adjustments": [], "on_adjust": "error"},
             "baseline": {"tokens_per_s": {"median": 100.0, "p10": 90.0, "p90": 110.0}},
             "spec": {"tokens_per_s": {"median": 150.0}, "tau": 1.98, "accept_rate": 0.33, "acceptance": [0.6, 0.5, 0.4]},
             "offline": {"tau": 2.02}, "speedup": 1.5, "server_log": None}
    (root / "reports/bench.json").write_text(json.dumps(bench))
    return root, model


@pytest.fixture
def run(pipeline, tmp_path):
    """A private copy of the pipeline outputs to damage (the target is shared, read-only)."""
    root, _ = pipeline
    for part in ("data", "reports", "models"):
        shutil.copytree(root / part, tmp_path / part)
    return tmp_path


def paths(root: Path) -> check_run.Paths:
    return check_run.Paths(root / "data/synth", root / "data/hidden", root / "data/features", root / "reports/train/metrics.json",
                        root / "models/draft", root / "reports/bench.json")


def diagnose(pipeline, root, **check):
    model = pipeline[1]
    check_params = CheckParams(**{**CHECK.__dict__, **check})
    return check_run.diagnose(paths(root), check_params, load_model=lambda *_: model)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_config(root, change):
    edit_json(root / "models/draft/config.json", change)


def edit_bench(root, change):
    edit_json(root / "reports/bench.json", change)


def edit_weights(root, change):
    path = root / "models/draft/model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path))


def edit_shards(root, change):
    """change(tensors, metadata) on every train shard of the features."""
    for path in sorted((root / "data/features/train").glob("shard-*.safetensors")):
        meta = read_metadata(path)
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        change(tensors, meta)
        save_file(tensors, str(path), metadata={k: json.dumps(v) for k, v in meta.items()})


def finding(d, name):
    hits = [f for f in d.findings if f.name == name]
    assert hits, f"{name} not reported; got {names(d.findings)}"
    return hits[0]


# --- the clean run ----------------------------------------------------------------------------


def test_clean_pipeline_reports_no_error_and_no_warning(pipeline, run):
    d = diagnose(pipeline, run)
    assert [f for f in d.findings if f.severity != "ok-info"] == [], [f.as_dict() for f in d.findings]
    assert {"live_parity_ok", "tau_consistent"} <= set(names(d.findings))
    assert d.parity["live_physical"] == PHYSICAL and all(s["rel_err"] < 0.01 for s in d.parity["slots"])  # bf16 rounding only
    assert d.settings["sglang_captures"] == PHYSICAL and d.settings["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


# --- fault 1: capture layers --------------------------------------------------------------------


@pytest.mark.parametrize("ids, shift, live", [([2, 4, 6], 1, [3, 5, 7]), ([0, 2, 4], -1, [1, 3, 5])])
def test_ids_shifted_by_one_are_named_with_direction_and_the_ids_to_write(pipeline, run, ids, shift, live):
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids))
    d = diagnose(pipeline, run)
    f = finding(d, "capture_layers_shifted")
    assert f.severity == "error" and f.evidence["shift"] == shift and f.evidence["sglang_captures"] == live
    assert "one too high" in f.cause if shift == 1 else "one too low" in f.cause
    assert "[1, 3, 5]" in f.fix
    # live parity through the engine's capture path sees the same shift, layer by layer
    slots = finding(d, "layer_shift").evidence["slots"]
    assert [s["matches_physical"] for s in slots] == live


def test_missing_eagle_config_names_the_silent_default(pipeline, run):
    edit_config(run, lambda c: c.pop("eagle_config"))
    d = diagnose(pipeline, run)
    f = finding(d, "eagle_config_missing")
    assert f.severity == "error" and f.evidence["sglang_captures"] == [2, 4, 5] and "default" in f.cause
    assert "[1, 3, 5]" in f.fix and "capture_layers_shifted" not in names(d.findings)


def test_ids_at_the_top_level_are_named_as_ignored(pipeline, run):
    edit_config(run, lambda c: c.update(eagle_aux_hidden_state_layer_ids=c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]))
    f = finding(diagnose(pipeline, run), "layer_ids_at_top_level")
    assert f.severity == "error" and "ignores" in f.cause and f.evidence["top_level_ids"] == [1, 3, 5]


def test_embedding_in_the_ids_is_named(pipeline, run):
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[-1, 3, 5]))
    f = finding(diagnose(pipeline, run), "embedding_captured")
    assert f.severity == "error" and f.evidence["side"] == "exported config" and "embedding" in f.cause


def test_embedding_in_the_training_features_is_named():
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]}})
    f = check_capture([0, 4, 6], served_layers(draft, {"architecture": "LlamaForCausalLM", "num_layers": 8}, "0.5.14"))
    assert "embedding_captured" in names(f) and next(x for x in f if x.name == "embedding_captured").evidence["side"] == "training features"


def test_last_layer_id_is_named_out_of_range_and_parity_sees_the_width(pipeline, run):
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 7]))
    d = diagnose(pipeline, run)
    f = finding(d, "layer_id_out_of_range")
    assert f.evidence["dropped_ids"] == [7] and "0..6" in f.cause
    assert finding(d, "live_width_mismatch").evidence["live_width"] == 2 * H


def test_unsorted_ids_are_fine_because_sglang_sorts(pipeline, run):
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[5, 1, 3]))
    d = diagnose(pipeline, run)
    assert d.errors == [] and finding(d, "layer_ids_unsorted").severity == "ok-info"


def test_features_out_of_ascending_order_are_named(pipeline, run):
    order = [1, 0, 2]  # slots hold physical [4, 2, 6]

    def permute(t, meta):
        t["aux_hidden"] = torch.cat([t["aux_hidden"][:, j * H:(j + 1) * H] for j in order], -1)
        meta["physical_layers"] = [PHYSICAL[j] for j in order]

    edit_shards(run, permute)
    d = diagnose(pipeline, run)
    assert finding(d, "feature_order_wrong").evidence.get("feature_physical_order") == [4, 2, 6]
    parity = [f for f in d.findings if f.name == "feature_order_wrong" and "slots" in f.evidence]
    assert parity and len(parity[0].evidence["slots"]) == 2  # slot 2 (physical 6) stayed in place


# --- faults 2-4: algorithm, d2t, shapes ---------------------------------------------------------


def test_eagle_algorithm_with_an_eagle3_draft_is_named_from_flags_or_log(pipeline, run):
    edit_bench(run, lambda b: b["flags"]["requested"].update(algorithm="EAGLE"))
    f = finding(diagnose(pipeline, run), "eagle_instead_of_eagle3")
    assert "skips fc" in f.cause and "bench.json flags.requested.algorithm" in f.evidence
    edit_bench(run, lambda b: b["flags"]["requested"].update(algorithm="EAGLE3"))
    log = run / "reports/server-spec.log"
    log.write_text("[2026-01-01] server_args=ServerArgs(model_path='t', speculative_algorithm='EAGLE', speculative_num_steps=3)\n")
    edit_bench(run, lambda b: b.update(server_log=str(log)))
    assert finding(diagnose(pipeline, run), "eagle_instead_of_eagle3").evidence["server log"]


def test_reduced_vocab_without_d2t_is_named(pipeline, run):
    edit_weights(run, lambda t: t.pop("d2t"))
    f = finding(diagnose(pipeline, run), "d2t_missing")
    assert f.evidence["draft_vocab_size"] == VD and f.evidence["vocab_size"] == V and "draft ids as target ids" in f.cause
    # The cost follows from the training vocab: the draft ids whose token is not their own index.
    d2t, _ = load_draft_vocab(run / "data/features/draft_vocab.safetensors")
    assert f.evidence["draft_ids_misread"] == int((d2t != 0).sum()) and f"of the {VD} draft ids" in f.cause


def test_all_zero_d2t_with_a_reduced_vocab_is_named(pipeline, run):
    edit_weights(run, lambda t: t.update(d2t=torch.zeros_like(t["d2t"])))
    d = diagnose(pipeline, run)
    assert finding(d, "d2t_all_zeros").severity == "error"


@pytest.mark.parametrize("name, damage, evidence", [
    ("fc_width_mismatch", lambda t: t.update({"fc.weight": torch.zeros(H, 4 * H, dtype=torch.bfloat16)}), {"expected_fc_in": 3 * H}),
    ("draft_tensors_mismatch", lambda t: t.update({"midlayer.hidden_norms.weight": t.pop("midlayer.hidden_norm.weight")}), {}),
])
def test_damaged_weights_are_named(pipeline, run, name, damage, evidence):
    edit_weights(run, damage)
    f = finding(diagnose(pipeline, run), name)
    assert f.severity == "error" and evidence.items() <= f.evidence.items()


@pytest.mark.parametrize("name, change", [
    ("draft_context_shorter", lambda c: c.update(max_position_embeddings=256)),
    ("draft_architecture_wrong", lambda c: c.update(architectures=["LlamaForCausalLM"])),
    ("draft_vocab_mismatch", lambda c: c.update(vocab_size=V * 2)),
])
def test_config_sizes_against_the_target_are_named(pipeline, run, name, change):
    edit_config(run, change)
    assert finding(diagnose(pipeline, run), name).severity == "error"


# --- fault 5: chat template and tokenizer -------------------------------------------------------


def test_a_changed_serving_chat_template_is_named_on_the_serving_side(pipeline, run):
    shutil.copytree(pipeline[0] / "target", run / "served")
    edit_json(run / "served/tokenizer_config.json", lambda c: c.update(chat_template=c["chat_template"].replace("<|end|>", "<|end|>\n")))
    edit_bench(run, lambda b: b["target"].update(model=str(run / "served")))
    f = finding(diagnose(pipeline, run), "chat_template_differs")
    assert f.evidence["differs"] == ["serving"] and "tokenizer_differs" not in names(diagnose(pipeline, run).findings)


def test_a_different_synthesis_tokenizer_is_named(pipeline, run):
    edit_json(run / "data/synth/manifest.json", lambda m: m["info"].update(tokenizer_hash="0" * 64))
    assert finding(diagnose(pipeline, run), "tokenizer_differs").evidence["differs"] == ["synthesis"]


def test_features_extracted_under_another_transformers_are_a_warning_naming_both(pipeline, run):
    """The run's manifests all came from this environment (the clean run above is quiet); the
    extract manifest now says an older transformers made the hidden states."""
    edit_json(run / "data/hidden/manifest.json", lambda m: m["packages"].update(transformers="4.99.0"))
    f = finding(diagnose(pipeline, run), "package_versions_differ")
    here = transformers.__version__
    assert f.severity == "warning" and f.evidence["package"] == "transformers"
    assert f.evidence["versions"] == {here: ["synthesize", "standardize", "export"], "4.99.0": ["extract"]}
    assert "transformers 4.99.0 (extract)" in f.cause and f"transformers {here} (synthesize, standardize, export)" in f.cause


# --- fault 6: dtype / normalisation -------------------------------------------------------------


def test_a_scaled_layer_is_named_a_norm_mismatch(pipeline, run):
    def scale(t, meta):  # the features of physical 4 were stored 3x too large (e.g. a normalisation at extraction)
        t["aux_hidden"][:, H:2 * H] *= 3

    edit_shards(run, scale)
    edit_json(run / "data/features/stats.json", lambda s: s["norms"]["4"].update({k: v * 3 for k, v in s["norms"]["4"].items()}))
    f = finding(diagnose(pipeline, run), "hidden_norm_mismatch")
    (slot,) = f.evidence["slots"]
    assert slot["trained_physical"] == 4 and slot["norm_ratio"] == pytest.approx(1 / 3, rel=0.01)
    assert slot["norm_ratio_vs_stats"] == pytest.approx(1 / 3, rel=0.05)


def test_norm_statistics_name_a_post_norm_capture_when_tokens_do_not_match():
    stats = {"2": {"mean": 10.0}, "4": {"mean": 20.0}, "6": {"mean": 30.0}, "final": {"mean": 8.0}}
    slot = {"slot": 2, "trained_physical": 6, "live_physical": None, "rel_err": 0.9, "max_abs_diff": 5.0, "cos": 0.3, "norm_ratio": 0.27,
            "live_norm": {"mean": 8.1}, "best_match": "physical 6", "best_rel_err": 0.9}
    parity = {"source": "url", "sequences": ["r0"], "tokens": 10, "trained_physical": [2, 4, 6], "slots": [slot], "error": None}
    (f,) = check_live_capture(parity, stats, rtol=0.05, norm_tolerance=0.15)
    assert f.name == "final_norm_applied" and f.evidence["slots"][0]["basis"] == "norm statistics"


# --- fault 7: flags -----------------------------------------------------------------------------


def test_each_flag_adjustment_is_a_finding(pipeline, run):
    def adjusted(b):
        b["flags"]["requested"]["num_draft_tokens"] = 16
        b["flags"]["on_adjust"] = "allow"
        b["flags"]["adjustments"] = [{"rule": "chain_draft_tokens", "kind": "adjusted", "what": "SGLang would run 4 draft tokens",
                                      "fix": "set spec.num_draft_tokens: 4", "sglang_message": None}]

    edit_bench(run, adjusted)
    f = finding(diagnose(pipeline, run), "flag_adjusted")
    assert f.evidence["rule"] == "chain_draft_tokens" and f.evidence["changed"] == {"num_draft_tokens": {"requested": 16, "effective": 4}}
    assert f.fix == "set spec.num_draft_tokens: 4"


def test_an_adjustment_only_the_server_log_shows_is_an_error(pipeline, run):
    log = run / "reports/server-spec.log"
    shutil.copy(Path(__file__).parent / "fixtures/sglang/adjustments.log", log)
    edit_bench(run, lambda b: b.update(server_log=str(log)))
    hits = [f for f in diagnose(pipeline, run).findings if f.name == "flag_adjusted"]
    assert {f.evidence["rule"] for f in hits} == {"chain_draft_tokens", "max_running_requests_default"}
    assert all(f.severity == "error" and f.evidence["source"] == "server log" for f in hits)


# --- fault 8: the tau triangle ------------------------------------------------------------------


def test_served_tau_far_below_offline_names_the_serving_link(pipeline, run):
    edit_bench(run, lambda b: b["spec"].update(tau=1.1))
    f = finding(diagnose(pipeline, run), "tau_offline_vs_served")
    assert f.severity == "error" and f.evidence["link"] == "offline -> served" and "fed differently" in f.cause
    assert f.evidence["train_predicted"] == 2.0  # tau_by_steps at the served num_steps (3)


def test_offline_tau_below_training_names_the_training_link():
    bench = {"flags": {"effective": {"num_steps": 4, "topk": 1}}, "offline": {"tau": 1.5}, "spec": {"tau": 1.5}}
    (f,) = check_tau({"tau_pred": 2.1, "tau_by_steps": {"steps_4": 2.1}}, bench, 0.10)
    assert f.name == "tau_train_vs_offline" and "overfit" in f.cause
    assert check_tau({"tau_pred": 2.1, "tau_by_steps": {"steps_4": 2.1}}, {**bench, "offline": {"tau": 2.0}, "spec": {"tau": 2.05}}, 0.10)[0].name == "tau_consistent"


def test_training_on_answers_longer_than_the_benchs_is_named_as_the_likely_cause():
    """The real workload's case: answers synthesized to 512 tokens (62% stopped there), benched at 256."""
    from draftlab.check.serving import answer_lengths

    bench = {"flags": {"effective": {"num_steps": 3, "topk": 1}}, "offline": {"tau": 1.85}, "spec": {"tau": 1.83}}
    train = {"tau_pred": 3.1, "tau_by_steps": {"steps_3": 2.44}}
    synth = {"params": {"synth": {"max_new_tokens": 512}}, "info": {"finish_reasons": {"length": 5816, "stop": 3515}}}
    lengths = answer_lengths(synth, {"params": {"bench": {"max_new_tokens": 256}}})
    assert lengths == {"synth_max_new_tokens": 512, "answers_cut_share": 0.623, "bench_max_new_tokens": 256}
    (f,) = check_tau(train, bench, 0.10, lengths)
    assert f.name == "tau_train_vs_offline" and "synth.max_new_tokens=512 (62% stopped there)" in f.cause
    assert "bench.max_new_tokens" in f.fix and f.evidence["answers_cut_share"] == 0.623
    # Answers of the bench's own length, or few of them cut: the generic causes only.
    for same in (answer_lengths(synth, {"params": {"bench": {"max_new_tokens": 512}}}),
                 answer_lengths({**synth, "info": {"finish_reasons": {"length": 10, "stop": 990}}},
                                {"params": {"bench": {"max_new_tokens": 256}}})):
        (g,) = check_tau(train, bench, 0.10, same)
        assert "synth.max_new_tokens" not in g.cause and "overfit" in g.cause
    assert answer_lengths(None, None) is None


def test_the_cut_share_of_conversations_counts_every_answer():
    """A manifest without answer_finish_reasons (written when a cut answer ended its conversation): a
    conversation's finish_reason is its last answer's and its earlier answers all stopped, so the share
    of answers cut is over synthesize's turns_answered."""
    from draftlab.check.serving import answer_lengths

    synth = {"params": {"synth": {"max_new_tokens": 512}},
             "info": {"finish_reasons": {"length": 300, "stop": 700}, "turns_answered": 3500}}
    lengths = answer_lengths(synth, {"params": {"bench": {"max_new_tokens": 256}}})
    assert lengths["answers_cut_share"] == round(300 / 3500, 3)


def test_the_cut_share_counts_every_cut_answer_where_synthesize_recorded_each():
    """A cut answer no longer ends its conversation: the cut answers are counted over every turn
    (answer_finish_reasons), not only each row's last."""
    from draftlab.check.serving import answer_lengths

    synth = {"params": {"synth": {"max_new_tokens": 512}},
             "info": {"finish_reasons": {"length": 300, "stop": 700}, "turns_answered": 3500,
                      "answer_finish_reasons": {"length": 2100, "stop": 1400}}}
    lengths = answer_lengths(synth, {"params": {"bench": {"max_new_tokens": 256}}})
    assert lengths["answers_cut_share"] == 0.6


# --- inputs -------------------------------------------------------------------------------------


def test_without_a_bench_report_the_other_checks_still_run(pipeline, run):
    (run / "reports/bench.json").unlink()
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]))
    d = diagnose(pipeline, run)
    assert finding(d, "bench_not_run").severity == "warning"
    assert {"capture_layers_shifted", "layer_shift"} <= set(names(d.findings))


def test_a_served_target_other_than_the_extracted_one_is_named(pipeline, run):
    edit_bench(run, lambda b: b["target"].update(num_layers=L + 1))
    assert finding(diagnose(pipeline, run), "served_target_differs").evidence["num_layers"] == {"features": L, "served": L + 1}


def test_an_export_from_other_features_is_named_stale(pipeline, run):
    edit_json(run / "models/draft/manifest.json", lambda m: m["inputs"].update(features="f" * 64))
    assert finding(diagnose(pipeline, run), "stale_outputs").evidence["stage"] == "export"


# --- live parity over HTTP ----------------------------------------------------------------------


@pytest.mark.parametrize("raw, shape", [
    ([[1.0] * 6] * 4, (4, 6)),  # flat [T][k*H]
    ([[[1.0] * 2] * 3] * 4, (4, 6)),  # [T][k][H]
    ([[[1.0] * 6] * 4, [1.0] * 6], (5, 6)),  # SGLang: the prompt block, then one row per generated token
])
def test_hidden_states_are_read_in_every_shape_servers_return(raw, shape):
    assert tuple(hidden_rows(raw, hidden_size=2).shape) == shape


@pytest.fixture(scope="module")
def stub_server(pipeline):
    """A tiny /generate that returns the hidden states a server would feed the draft, in SGLang's shape.

    The served capture is set per test through `state`: the physical layers, or "final" to put
    the post-norm final state into the last slot.
    """
    import uvicorn
    from fastapi import FastAPI

    from draftlab.lifecycle import free_port

    model = pipeline[1]
    state = {"physical": PHYSICAL, "final": False, "cached": 0}
    app = FastAPI()

    @app.post("/generate")
    def generate(body: dict):
        ids = body["input_ids"]
        assert body["return_hidden_states"] and body["sampling_params"]["temperature"] == 0
        live, _ = inprocess_capture(model, state["physical"])(ids)
        if state["final"]:
            _, final = capture(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), [])
            live[:, 2 * H:] = final[0]
        block = live.bfloat16().float().tolist()
        c = state["cached"]  # SGLang's prefix cache: no rows for the first c prompt tokens
        return {"text": "x", "output_ids": [5], "meta_info": {"completion_tokens": 1, "cached_tokens": c, "hidden_states": [block[c:], block[-1]]}}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("cached", [0, 3])
def test_http_parity_passes_for_a_server_feeding_the_trained_layers(pipeline, run, stub_server, cached):
    """cached=3: rows start after the prefix SGLang took from its radix cache (meta_info cached_tokens)."""
    url, state = stub_server
    state.update(physical=PHYSICAL, final=False, cached=cached)
    d = diagnose(pipeline, run, server_url=url)
    assert d.errors == [] and finding(d, "live_parity_ok").evidence["source"] == url
    assert max(s["rel_err"] for s in d.parity["slots"]) < 0.02
    assert d.parity["cached_tokens"] == cached * len(d.parity["sequences"])
    state.update(cached=0)


def test_http_parity_names_a_post_norm_capture_and_a_shift(pipeline, run, stub_server):
    url, state = stub_server
    state.update(physical=PHYSICAL, final=True)
    (slot,) = finding(diagnose(pipeline, run, server_url=url), "final_norm_applied").evidence["slots"]
    assert slot["trained_physical"] == 6 and slot["best_match"] == "final"
    state.update(physical=[4, 6, 7], final=False)  # a server two layers deeper: slots 0 and 1 equal stored slots 1 and 2
    slots = finding(diagnose(pipeline, run, server_url=url), "layer_shift").evidence["slots"]
    assert [(s["trained_physical"], s["matches_physical"]) for s in slots[:2]] == [(2, 4), (4, 6)]
    assert slots[2]["matches_physical"] == 7  # a layer the features never held: named from the local target's layers
    state.update(physical=[3, 5, 7])  # ids shifted by one: no live slot equals any stored one
    slots = finding(diagnose(pipeline, run, server_url=url), "layer_shift").evidence["slots"]
    assert [s["matches_physical"] for s in slots] == [3, 5, 7]
    state.update(physical=PHYSICAL)


def test_parity_cli_against_a_server(pipeline, stub_server, capsys):
    url, state = stub_server
    state.update(physical=PHYSICAL, final=False)
    assert __main__.parity_main(["--url", url, "--features", str(pipeline[0] / "data/features"), "--samples", "2"]) == 0
    assert "live_parity_ok" in capsys.readouterr().out


def test_parity_against_an_unreachable_server_is_an_error_not_a_crash(pipeline, run):
    from draftlab.lifecycle import free_port

    url = f"http://127.0.0.1:{free_port()}"
    d = diagnose(pipeline, run, server_url=url, request_timeout_s=2.0)
    f = finding(d, "live_parity_failed")
    assert f.severity == "error" and url in f.cause
    d = diagnose(pipeline, run, server_url="", live_parity_samples=0)  # the params say skip: no error
    assert d.errors == [] and finding(d, "live_parity_skipped")


def test_parity_cli_against_a_dead_server_exits_2_with_the_reason(pipeline, capsys):
    from draftlab.lifecycle import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as e:
        __main__.main(["parity", "--url", url, "--features", str(pipeline[0] / "data/features"), "--samples", "1", "--timeout", "2"])
    assert e.value.code == 2 and url in capsys.readouterr().err


def test_a_features_shard_gone_is_an_error_in_diagnose_the_stage_and_the_parity_cli(pipeline, run, monkeypatch, capsys):
    from draftlab.manifest import output_files
    from stages.check import main

    feat = run / "data/features"
    edit_json(feat / "manifest.json", lambda m: m["info"].update(files=output_files(feat)))  # as standardize records them
    assert diagnose(pipeline, run).errors == []
    (feat / "train/shard-00001.safetensors").unlink()
    d = diagnose(pipeline, run)
    f = finding(d, "input_damaged")
    assert f.severity == "error" and "shard-00001.safetensors: missing" in f.cause and "dvc repro standardize" in f.cause
    monkeypatch.chdir(run)
    (run / "params.yaml").write_text(PARAMS % "true")
    with pytest.raises(UserError, match="input_damaged"):
        main(paths(run), run / "reports", load_model=lambda *_: pipeline[1])
    with pytest.raises(SystemExit) as e:
        __main__.main(["parity", "--features", str(feat), "--draft", str(run / "models/draft")])
    assert e.value.code == 2 and "shard-00001.safetensors: missing" in capsys.readouterr().err


def test_a_truncated_features_shard_is_named_not_a_traceback(pipeline, run):
    shard = run / "data/features/train/shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    f = finding(diagnose(pipeline, run), "input_damaged")
    assert f.severity == "error" and "truncated" in f.cause and "shard-00000" in f.cause


@pytest.mark.parametrize("eagle", [{"eagle_aux_hidden_state_layer_ids": ["2", "4", "6"]},
                                   {"eagle_aux_hidden_state_layer_ids": "2,4,6"}, "ids"])
def test_malformed_layer_ids_are_a_named_finding(pipeline, run, eagle):
    edit_config(run, lambda c: c.update(eagle_config=eagle))
    d = diagnose(pipeline, run)
    assert names(d.errors) == ["eagle_config_invalid"]
    with pytest.raises(UserError, match="not a list of integers|not an object"):
        __main__.parity_main(["--features", str(run / "data/features"), "--draft", str(run / "models/draft")])


def reference_server(pipeline, draft: Path, log: Path):
    """The project's reference server (python -m draftlab.server) speculating with `draft`, hidden states on."""
    import os

    from draftlab.lifecycle import free_port, serve
    from draftlab.engine.server import launch_command

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    port = free_port()
    argv = launch_command(pipeline[0] / "target", port, dtype="float32", device="cpu", log_level="warning",
                          speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_num_steps=3,
                          speculative_eagle_topk=1, speculative_num_draft_tokens=4, sglang_version="0.5.14",
                          enable_return_hidden_states=True)
    return serve(argv, f"http://127.0.0.1:{port}", log, startup_timeout_s=120, env=env)


def test_parity_against_the_reference_server_passes_and_names_a_miswired_export(pipeline, run):
    with reference_server(pipeline, run / "models/draft", run / "clean.log") as srv:
        d = diagnose(pipeline, run, server_url=srv.url)
    assert d.errors == [] and finding(d, "live_parity_ok").evidence["max_rel_err"] < 0.01
    # ids [3, 5, 6] make the server capture physical [4, 6, 7]: two slots hold what training put one slot
    # later, and the third a layer the features never held (named from the local target's layers)
    edit_config(run, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[3, 5, 6]))
    with reference_server(pipeline, run / "models/draft", run / "shifted.log") as srv:
        d = diagnose(pipeline, run, server_url=srv.url)
    assert finding(d, "capture_layers_mismatch").evidence["sglang_captures"] == [4, 6, 7]
    slots = finding(d, "layer_shift").evidence["slots"]
    assert [(s["trained_physical"], s["matches_physical"]) for s in slots] == [(2, 4), (4, 6), (6, 7)]


# --- the stage ----------------------------------------------------------------------------------


PARAMS = """check: {tau_tolerance: 0.1, fail_on_error: %s, live_parity_samples: 2, parity_rtol: 0.05, norm_tolerance: 0.15,
  server_url: "", serve_parity: false, request_timeout_s: 30.0}
"""


def test_stage_writes_reports_with_lineage_and_fails_on_errors(pipeline, run, monkeypatch):
    from stages.check import main

    model = pipeline[1]
    monkeypatch.chdir(run)
    (run / "params.yaml").write_text(PARAMS % "true")
    shutil.copy(Path(__file__).resolve().parents[1] / "dvc.yaml", run / "dvc.yaml")  # it names the plots the run writes
    for png in ("train/plots/accept.png", "gpu-8b/speedup.png"):  # the run's own, and another experiment's kept beside it
        (run / "reports" / png).parent.mkdir(parents=True, exist_ok=True)
        (run / "reports" / png).write_bytes(b"\x89PNG")
    main(paths(run), run / "reports", load_model=lambda *_: model)
    report = json.loads((run / "reports/check.json").read_text())
    assert report["ok"] and report["stage"] == "check" and len(report["config_hash"]) == 64
    assert report["settings"]["sglang_captures"] == PHYSICAL and report["settings"]["backend"] == "reference"
    summary = (run / "reports/summary.md").read_text()
    assert "[train/plots/accept.png](train/plots/accept.png)" in summary and report["config_hash"] in summary
    assert "gpu-8b" not in summary
    assert "| tau served | 1.980 |" in summary

    edit_config(run, lambda c: c.pop("eagle_config"))
    with pytest.raises(UserError, match="eagle_config_missing"):
        main(paths(run), run / "reports", load_model=lambda *_: model)
    assert "`eagle_config_missing`" in (run / "reports/check.md").read_text()  # written before failing
    (run / "params.yaml").write_text(PARAMS % "false")
    d = main(paths(run), run / "reports", load_model=lambda *_: model)
    assert names(d.errors) == ["eagle_config_missing", "layer_shift"]


# --- the rehearsed faults (draftlab.check.faults): each one is named --------------------------------


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_rehearsed_fault_is_named_by_the_check(pipeline, run, name):
    fault = FAULTS[name]
    fixed = miswire(run / "models/draft", run / "miswired", fault)
    shutil.rmtree(run / "models/draft")
    fixed.rename(run / "models/draft")
    if fault.spec:  # what the bench of a server launched with these flags reports
        spec = {k: v for k, v in fault.spec.items() if k != "on_adjust"}
        res = resolve(SpecFlags(**{**FLAGS, **spec}), "LlamaForCausalLM", "0.5.14", draft_architecture="LlamaForCausalLMEagle3")
        served = {**dataclasses.asdict(res.requested if fault.force_requested else res.effective)}
        served["num_draft_tokens"] = res.effective.num_draft_tokens  # SGLang adjusts what it can
        edit_bench(run, lambda b: b.update(flags={**res.as_dict(), "served": served, "on_adjust": fault.spec.get("on_adjust", "error"),
                                                  "adjustments": [dataclasses.asdict(f) for f in res.adjustments]}))
    found = names(diagnose(pipeline, run).findings)
    assert set(fault.expect) & set(found), (name, found)


def test_the_miswired_copy_changes_only_what_the_fault_says(pipeline, run):
    src = run / "models/draft"
    shifted = miswire(src, run / "a", FAULTS["ids_shifted"])
    ids = lambda d: json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # noqa: E731
    assert ids(shifted) == [i + 1 for i in ids(src)]
    assert "eagle_config" not in json.loads((miswire(src, run / "b", FAULTS["no_eagle_config"]) / "config.json").read_text())
    with safe_open(str(miswire(src, run / "c", FAULTS["d2t_dropped"]) / "model.safetensors"), "pt") as f:
        kept = set(f.keys())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert kept == set(f.keys()) - {"d2t"}
    flags_only = miswire(src, run / "d", FAULTS["eagle_not_eagle3"])
    assert (flags_only / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_a_server_running_other_flags_than_params_is_named(pipeline, run):
    edit_bench(run, lambda b: b["flags"].update(served={**FLAGS, "num_steps": 2, "num_draft_tokens": 3}))
    f = finding(diagnose(pipeline, run), "served_flags_differ")
    assert f.evidence["flags"]["num_steps"] == {"effective": 3, "served": 2}
    edit_bench(run, lambda b: b["flags"].update(served={**FLAGS, "algorithm": "EAGLE"}))
    assert "served" in " ".join(finding(diagnose(pipeline, run), "eagle_instead_of_eagle3").evidence)


# --- a draft that captures the embedding output (physical 0) ----------------------------------------


def test_embedding_trained_draft_served_where_sglang_captures_it_is_clean():
    # Llama from 0.5.22: id -1 captures physical 0 (layer-boundary capture)
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5]}})
    f = check_capture([0, 4, 6], served_layers(draft, {"architecture": "LlamaForCausalLM", "num_layers": 8}, "0.5.22"))
    assert [x for x in f if x.severity == "error"] == [] and "embedding_served" in names(f)
    # DeepSeek-V3 from 0.5.14: a first id 0 is taken as-is (measured on 0.5.14: [0, 3, 5] -> hidden_states[0], [3], [5])
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}})
    served = served_layers(draft, {"architecture": "DeepseekV3ForCausalLM", "num_layers": 8}, "0.5.14")
    assert served.physical == [0, 3, 5] and not [x for x in check_capture([0, 3, 5], served) if x.severity == "error"]


def test_embedding_trained_draft_served_by_a_release_that_crashes_on_it_names_the_version():
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5]}})
    f = check_capture([0, 4, 6], served_layers(draft, {"architecture": "LlamaForCausalLM", "num_layers": 8}, "0.5.21"))
    found = [x for x in f if x.name == "embedding_captured"]
    assert {x.evidence["side"] for x in found} == {"training features", "exported config"}
    assert all(x.severity == "error" for x in found) and "0.5.22" in found[0].fix


def test_a_qwen3_draft_on_the_embedding_is_an_error_where_sglang_feeds_an_overwritten_tensor():
    # Measured on 0.5.14: the server runs, but slot 0 holds the residual the later layers wrote into the embedding tensor.
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5]}})
    f = check_capture([0, 4, 6], served_layers(draft, {"architecture": "Qwen3ForCausalLM", "num_layers": 8}, "0.5.14"))
    found = [x for x in f if x.name == "embedding_captured" and x.evidence["side"] == "training features"]
    assert found and found[0].severity == "error" and "overwritten tensor" in found[0].cause and "0.5.21" in found[0].fix
    f = check_capture([0, 4, 6], served_layers(draft, {"architecture": "Qwen3ForCausalLM", "num_layers": 8}, "0.5.21"))
    assert [x for x in f if x.severity == "error"] == [] and "embedding_served" in names(f)


def test_ids_that_capture_the_embedding_instead_of_layer_zero_are_named():
    # trained on decoder layer 0's output (physical 1); the config's -1 makes SGLang 0.5.22 feed the embedding
    draft = ExportedDraft(Path("d"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5]}})
    f = check_capture([1, 4, 6], served_layers(draft, {"architecture": "LlamaForCausalLM", "num_layers": 8}, "0.5.22"))
    hit = [x for x in f if x.name == "embedding_captured"]
    assert hit and hit[0].severity == "error" and hit[0].evidence["sglang_captures"] == [0, 4, 6]
    assert "[0, 3, 5]" in hit[0].fix


def _embedding_parity(tmp_path, live_physical):
    from draftlab.check.parity import StoredSequence, reference_states, run_parity

    model = save_micro_model(tmp_path / "target", num_layers=L, hidden_size=H, vocab_size=V, seed=0)
    trained = [0, 4, 6]
    seqs = []
    for i, (q, a) in enumerate(CHATS[:2]):
        ids = torch.tensor([[7 + i + j for j in range(12)]])
        aux, final = capture(model, ids, torch.ones_like(ids), trained)
        seqs.append(StoredSequence(f"r{i}", ids[0].tolist(), torch.cat([aux[p][0] for p in trained], -1).float(), final[0].float()))
    meta = {"physical_layers": trained, "hidden_size": H}
    return run_parity(seqs, meta, inprocess_capture(model, live_physical), "in-process", reference_states(model), live_physical)


def test_live_parity_checks_the_embedding_slot_like_any_layer(tmp_path):
    ok = _embedding_parity(tmp_path, [0, 4, 6])
    assert names(check_live_capture(ok, {}, 0.05, 0.15)) == ["live_parity_ok"]
    assert ok["slots"][0]["best_match"] == "physical 0" and ok["slots"][0]["rel_err"] < 1e-6


def test_live_parity_names_layer_zero_served_where_the_embedding_was_trained(tmp_path):
    shifted = _embedding_parity(tmp_path, [1, 4, 6])
    f = check_live_capture(shifted, {}, 0.05, 0.15)
    (hit,) = [x for x in f if x.name == "layer_shift"]
    assert [(s["trained_physical"], s["matches_physical"]) for s in hit.evidence["slots"]] == [(0, 1)]


def test_an_eval_split_of_later_turns_is_named_when_its_first_answers_decode_as_the_bench_did():
    """The every-turn workload's case: the eval split's answers are every turn (later ones easier),
    the bench sends first turns. Training's decoding replayed over first answers alone matches offline:
    the check says so, with the figures, and calls no fault."""
    from draftlab.check.findings import INFO

    bench = {"flags": {"effective": {"num_steps": 3, "topk": 1}}, "offline": {"tau": 2.0}, "spec": {"tau": 1.96},
             "prompt_sets": [{"name": "heldout", "turns": 1}]}
    train = {"tau_pred": 3.56, "tau_by_steps": {"steps_3": 2.65},
             "tau_decoded_first_turns_by_steps": {"steps_1": 1.5, "steps_2": 1.8, "steps_3": 2.05},
             "step1_by_turn": {"1": {"tokens": 300, "a_1": 0.55}, "2": {"tokens": 200, "a_1": 0.7}, "3+": {"tokens": 500, "a_1": 0.8}}}
    (f,) = check_tau(train, bench, 0.10)
    assert (f.name, f.severity) == ("tau_train_vs_offline", INFO)
    assert f.evidence["first_turns_decoded"] == 2.05 and f.evidence["later_turns_share"] == 0.7
    assert "70% of its tokens after the first turn" in f.cause and "2.05" in f.cause
    # First answers that decode far above offline, a bench of several turns, or an eval of first turns only:
    # the gap stays a warning with the generic causes.
    for t, b in (({**train, "tau_decoded_first_turns_by_steps": {"steps_3": 2.6}}, bench),
                 (train, {**bench, "prompt_sets": [{"name": "mt-bench", "turns": 2}]}),
                 ({**train, "step1_by_turn": {"1": {"tokens": 300, "a_1": 0.55}, "2": {"tokens": 0, "a_1": None}}}, bench)):
        (g,) = check_tau(t, b, 0.10)
        assert (g.name, g.severity) == ("tau_train_vs_offline", "warning") and "overfit" in g.cause
