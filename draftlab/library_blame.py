"""A folder the project wrote itself that does not load: the library is named first, not the folder.

The target stage writes models/target-dequantized from a GGUF target (draftlab.gguf_target, with
gguf-source.json beside the weights) and checks that it loads; every stage loads it after. A load
error there, on files the stage wrote and checked, almost always means the installed transformers
(or a package it calls into) reads the folder differently from the release that wrote it. So the
message starts with that library and its version, says which release wrote the folder, and says
to install the versions the project pins, instead of telling the user to fix a folder they never
touched. A folder that is damaged (a file cut or edited) is told apart by its files
(draftlab.target_check.folder_problem) and made again by the target stage.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from draftlab.errors import UserError


def written_folder(model: str) -> Path | None:
    """The folder the target stage wrote for `model` (a GGUF target, or that folder named directly),
    or None for a folder or hub id the user gave."""
    from draftlab.gguf_target import DEQUANTIZED_DIR, SOURCE_FILE, gguf_file

    try:
        folder = DEQUANTIZED_DIR if gguf_file(model) is not None else Path(model).expanduser()
    except UserError:  # a GGUF path that is not there: not a folder of ours
        return None
    return folder if (folder / SOURCE_FILE).is_file() else None


def source_record(folder: Path) -> dict:
    """gguf-source.json of a folder the target stage wrote ({} when unreadable)."""
    from draftlab.gguf_target import SOURCE_FILE

    try:
        record = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def raising_package(e: BaseException) -> tuple[str, str] | None:
    """(distribution, version) of the innermost installed package the exception passed through (a
    frame under site-packages; the standard library and the project's own code are not packages
    installed there), or None."""
    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    owners = metadata.packages_distributions()  # top-level module -> distributions that install it
    for frame in reversed(frames):
        path = frame.f_code.co_filename.replace("\\", "/")
        top = (frame.f_globals.get("__name__") or "").split(".")[0]
        if ("/site-packages/" not in path and "/dist-packages/" not in path) or top not in owners:
            continue
        dist = owners[top][0]
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def reinstall() -> str:
    from draftlab.packaged import REAL_INSTALL

    return (f"install the versions the project pins (README.md, \"A real workload\": {REAL_INSTALL}), "
            f"then run the target stage again (dvc repro --force target)")


def library_first(folder: Path, what: str, part: str, e: Exception) -> str:
    """The message for `e`, raised while loading `what` from `folder`, a folder the target stage wrote."""
    import transformers

    from draftlab.target_check import cause_of, folder_problem

    record = source_record(folder)
    made_from = f" from {record['gguf']!r}" if record.get("gguf") else ""
    problem = folder_problem(folder, part)
    if problem:  # the files show the damage: not the library
        return (f"{folder}, the folder the target stage wrote{made_from}, does not load ({what}): {problem}; "
                f"make it again: dvc repro --force target")
    names = ["transformers"]
    library = f"transformers {transformers.__version__}"
    origin = raising_package(e)
    if origin and origin[0].lower() != "transformers":
        library += f" (through {origin[0]} {origin[1]}, where the error was raised)"
        names.append(origin[0])
    by = f" with transformers {record['transformers']}" if record.get("transformers") else ""
    return (f"{library} could not load {folder}, the folder the target stage wrote{made_from}{by}: "
            f"cannot load {what}: {cause_of(e).rstrip('.')}; the folder is the project's own output, so the cause is most "
            f"likely this release of {' or '.join(names)}, not the folder: {reinstall()}")
