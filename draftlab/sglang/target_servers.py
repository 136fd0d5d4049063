"""SGLang servers of the target for a stage's lifetime: synthesis answers through them, and self
prompts (draftlab.data.self_prompts) are written by them.

synth.servers_per_gpu servers on each visible GPU (draftlab.sglang.fleet plans them), each launched
with `python -m sglang.launch_server` for the folder every stage loads (a GGUF target's dequantized
one) in target.dtype on a free port, with synth.server_args; stopped on leaving (an error or Ctrl-C
too). Where each server's start-up went (imports, weights, CUDA graphs, ...) is printed and kept.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from draftlab.sglang.fleet import DEFAULT_SHARED_MEM
from draftlab.target.load import load_config, model_path, target_info


# The launch flags synth.server_args may not hold: the stage sets them (SGLang's --tp-size stays 1 here;
# for a target that needs tensor parallelism start SGLang yourself and use synth.backend: openai).
SERVER_MANAGED = {"--model-path": "target.model", "--model": "target.model", "--host": "(always 127.0.0.1)",
                  "--port": "(a free port)", "--dtype": "target.dtype", "--tp-size": "(1; see the stage's docstring)",
                  "--tp": "(1)", "--tensor-parallel-size": "(1)",
                  "--mem-fraction-static": "synth.mem_fraction_static (the share of each GPU for all its servers)"}


@contextlib.contextmanager
def own_servers(target_params, synth_params, out: Path, startups: list | None = None, stage: str = "synthesize"):
    """synth.backend sglang: SGLang servers of the target for the stage's lifetime (synth.servers_per_gpu
    on each visible GPU, draftlab.sglang.fleet); yields their /v1 URLs. Servers that share a GPU get
    explicit KV pools and start together; where that GPU's memory cannot be read, one after another.
    startups: a list to receive where each server's start-up went (draftlab.sglang.startup); stage: the
    name its messages start with."""
    from draftlab import lifecycle
    from draftlab.sglang import fleet, startup
    from draftlab.sglang.launch import free_port, launch_argv

    folder = model_path(target_params.model)
    per_gpu = fleet.servers_per_gpu(synth_params.servers_per_gpu, folder)
    size = fleet.footprint(folder, target_info(load_config(target_params), target_params), target_params.dtype) if per_gpu > 1 else None
    plan = fleet.plan_servers(per_gpu, fleet.visible_gpus(), synth_params.mem_fraction_static, size)
    given = [fleet.with_given_pool(p, synth_params.server_args, "synth.server_args") for p in plan]  # a --max-total-tokens of the user's
    plan = [p for p, _ in given]
    ports: list[int] = []
    while len(ports) < len(plan):  # distinct: each free_port() call is free on its own
        port = free_port()
        if port not in ports:
            ports.append(port)
    fleet.check_fa3(synth_params.server_args, "synth.server_args")  # once, before any server loads its weights
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for i, ((planned, extra), port) in enumerate(zip(given, ports)):
        argv = launch_argv(folder, port, baseline=True, dtype=target_params.dtype, extra_args=extra + planned.args(),
                           extra_key="synth.server_args", managed={k: v for k, v in SERVER_MANAGED.items() if k != "--mem-fraction-static"})
        log = out / (".sglang-server.log" if len(plan) == 1 else f".sglang-server-{i}.log")
        specs.append((argv, f"http://127.0.0.1:{port}", log, fleet.server_env(planned)))
    print(f"{stage}: starting {len(plan)} SGLang server(s) of {target_params.model} on {_where(plan)} "
          f"({_memory_text(plan[0], synth_params.mem_fraction_static, per_gpu)}; logs {out}/.sglang-server*.log)")
    # A server with an explicit pool is a group of its own: it starts beside the others (lifecycle.serve_many)
    groups = [i if p.explicit else p.gpu for i, p in enumerate(plan)]
    with lifecycle.serve_many(specs, synth_params.startup_timeout_s, groups=groups) as servers:
        got = [startup.server_startup(srv) for srv in servers]
        if startups is not None:
            startups.extend(got)
        startup.announce(stage, got)
        yield [f"{srv.url}/v1" for srv in servers]


def _where(plan) -> str:
    return ", ".join(sorted({f"GPU {p.gpu}" for p in plan if p.gpu is not None})) or "the visible devices"


def _memory_text(planned, share: float | None, per_gpu: int) -> str:
    """What each server of the plan gets, for the stage's first line."""
    if planned.explicit:
        return (f"{share or DEFAULT_SHARED_MEM} of each GPU for its {per_gpu} servers: each a KV pool of {planned.max_total_tokens} "
                f"tokens, started together")
    together = "started one after another" if per_gpu > 1 else "one per GPU"
    return f"memory share {planned.mem_fraction or 'SGLang default'} each, {together}"
