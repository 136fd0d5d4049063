"""Stage target: pin the target LLM that target.model names (draftlab/target/pin.py).

    python -m stages.target --out models/target-pin.json
Reads params keys: target.model, target.revision.

A local folder is pinned by the content hash of its model files, a hub id by the commit its
revision resolves to (offline from the local Hugging Face cache). A GGUF file is pinned by its
sha256 and dequantized once into models/target-dequantized (draftlab/target/gguf.py: DEQUANTIZED_DIR,
the folder every stage then loads and SGLang serves; its manifest.json records the stage, its wall time
included); for any other target that folder holds only a note. Every stage that loads the
target depends on the pin, not on the target's files, so another target is one params edit:
`dvc exp run -S target.model=org/name` re-makes the pin and re-runs what loads the target.

When the pin is re-made: DVC runs this stage when target.model or target.revision changes (its
params) or its code does; the stages after it re-run only when the pin's bytes change. The stage
is deliberately not `always_changed`: that would run it on every `dvc repro` and keep
`dvc status` from ever being clean ("nothing changed runs nothing" would no longer hold). The
price: files of a local target edited in place, or a hub branch that moved, are not seen until
`dvc repro --force target` (then a plain `dvc repro` re-runs what the new pin changes).

A local folder that transformers cannot load as a target is refused before anything is pinned
(draftlab.target.check.check_loadable: its files, config.json, the tokenizer and chat template,
the weights' names and shapes from the safetensors headers), so that no later stage trips on it.
"""
from __future__ import annotations

from pathlib import Path

from draftlab.cli import run_stage_cli
from draftlab.fsutil import atomic_write_json
from draftlab.target.gguf import DEQUANTIZED_DIR, gguf_file, materialize, placeholder
from draftlab.manifest import build_manifest, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.target.load import check_model_name
from draftlab.target.check import check_loadable
from draftlab.target.pin import pin_local, pin_target


def main(out: Path) -> None:
    dequantized = DEQUANTIZED_DIR
    params = load_params(["target"])
    target = params.target
    check_model_name(target.model)  # an empty value or an invalid hub id, named before anything is read or asked
    if gguf_file(target.model) is None:
        check_loadable(target.model, target.revision)  # no pin of a folder the stages cannot load
    pin, how = pin_target(target.model, target.revision)
    if pin["kind"] == "gguf":
        materialize(gguf_file(target.model), target.model, pin["gguf_sha256"], dequantized)
        check_loadable(str(dequantized))  # what every stage will load
        folder = pin_local(str(dequantized), dequantized)
        pin |= {"dequantized": dequantized.as_posix(), "content_sha256": folder["content_sha256"], "files": folder["files"]}
        # Beside the weights (outside the pin and the content hash): the stage's record, its wall time included.
        write_manifest(dequantized, build_manifest("target", as_dict(params), {"gguf_sha256": pin["gguf_sha256"]}, __file__,
                                                   {"content_sha256": pin["content_sha256"]}))
    else:
        placeholder(dequantized)
    atomic_write_json(out, pin)
    what = {"hashed": f"GGUF sha256 {pin.get('gguf_sha256', '')[:12]}, dequantized to {dequantized}" if pin["kind"] == "gguf" else
            f"content sha256 {pin.get('content_sha256', '')[:12]} over {len(pin.get('files', {}))} files",
            "given": f"commit {pin.get('commit')} (as given)", "hub": f"commit {pin.get('commit')} (resolved on the hub)",
            "cache": f"commit {pin.get('commit')} (resolved from the local Hugging Face cache)"}[how]
    print(f"target: {target.model} ({pin['kind']}): {what} -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, out="models/target-pin.json")
