"""Stage export: write the trained draft as an SGLang EAGLE-3 checkpoint.

    python -m stages.export --ckpt models/draft-ckpt --features data/features --out models/draft --report reports/export.json
Reads params section: export (the target facts come from the features manifest, the capture
layers from the feature shards).
Refuses, naming the reason, when SGLang could not capture the layers the draft was trained on or
could not load the draft.
"""
from __future__ import annotations

import sys
from pathlib import Path

from draftlab.cli import run_stage_cli
from draftlab.errors import UserError
from draftlab.features.dataset import check_manifest_target, physical_layers_of
from draftlab.fsutil import atomic_write_json
from draftlab.manifest import build_manifest, read_manifest, read_verified, with_lineage, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.sglang.checkpoint import export_sglang
from draftlab.sglang.layers import release_warning, user_layers_from_physical
from draftlab.train.saved import load_draft

FORMATS = ("sglang",)  # vLLM speculators: not written until it can be checked against a real vLLM


def main(ckpt: Path, features: Path, out: Path, report: Path) -> None:
    params = load_params(["export"])
    export_params = params.export
    for fmt in export_params.formats:
        if fmt not in FORMATS:
            raise UserError(f"params.yaml: export.formats: {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    features_manifest = read_verified(features)  # every shard standardize recorded, complete
    target = (features_manifest.get("info") or {}).get("target")
    if not isinstance(target, dict) or not target:
        raise UserError(f"{features}/manifest.json lacks info.target; re-run the standardize stage")
    check_manifest_target(features, target)
    train_manifest = read_manifest(ckpt)
    trained_on = (train_manifest.get("inputs") or {}).get("features")
    if trained_on and trained_on != features_manifest["config_hash"]:
        raise UserError(f"{ckpt} was trained on other features (config {trained_on[:12]}) than {features} holds "
                        f"(config {features_manifest['config_hash'][:12]}); run dvc repro")
    physical = sorted(physical_layers_of(features))
    draft = load_draft(ckpt)
    inputs = {"train": train_manifest["config_hash"], "features": features_manifest["config_hash"]}
    manifest = build_manifest("export", as_dict(params), inputs, __file__)
    release = release_warning(export_params.sglang_version)
    if release:
        print(f"warning: {release}", file=sys.stderr)
    config = export_sglang(draft, out, target, physical, export_params.sglang_version, export_params.dtype)

    layer_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    manifest["info"] = {"config": config, "bytes": sum(p.stat().st_size for p in out.iterdir())}
    write_manifest(out, manifest)
    settings = {"target_model": target.get("model"), "target_revision": target.get("revision"),
                "architecture": target["architecture"], "capture_layers": user_layers_from_physical(physical),
                "physical_layers": physical, "sglang_version": export_params.sglang_version,
                "draft_vocab_size": config["draft_vocab_size"], "dtype": export_params.dtype,
                "ttt_steps": ((train_manifest.get("params") or {}).get("train") or {}).get("ttt_steps")}
    figures = {"eagle_aux_hidden_state_layer_ids": layer_ids, "max_position_embeddings": config["max_position_embeddings"],
               "bytes": manifest["info"]["bytes"]}
    if release:
        settings["sglang_version_warning"] = release
    atomic_write_json(report, with_lineage(figures, manifest, settings))
    print(f"export: SGLang EAGLE-3 draft, eagle_aux_hidden_state_layer_ids {layer_ids} "
          f"(physical {physical}, SGLang {export_params.sglang_version}) -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, ckpt="models/draft-ckpt", features="data/features", out="models/draft", report="reports/export.json")
