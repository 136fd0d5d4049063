"""Several SGLang servers of one target, for throughput: planned, started together, stopped together.

A small target leaves one server's scheduler as the limit, not the GPU: SGLang spends a few ms of
host work per decode step whatever the batch, and a 135M model's forward takes about as long. Measured
on one H200 with SGLang 0.5.14 and SmolLM2-135M (greedy, up to 512 new tokens, ShareGPT first turns):
one server 18.7k tok/s, one server with --num-continuous-decode-steps 4 23.9k, three servers on the
one GPU (memory 0.25 each) 56.2k. So a small target gets several servers per GPU, each with its
share of the GPU's memory; a large one gets one per GPU.

    plan = plan_servers(per_gpu=3, gpus=["0"], mem_fraction=0.75, footprint=footprint(folder, info, "bfloat16"))
    plan[0].args()   # ["--mem-fraction-static", "0.875", "--max-total-tokens", "1234567"]: 0.25 of GPU 0 each

The servers of one GPU start at the same time (one start-up, ~70 s, rather than one per server).
SGLang 0.5.14 sizes its KV pool when it starts, as the memory free once its weights are loaded less
(1 - --mem-fraction-static) x the memory free when it started
(model_runner_kv_cache_mixin._profile_available_bytes): a server loading beside another sees the
other's pool taken, and refuses ("Loaded weights leave no GPU memory for the KV cache"). So each
gets an explicit pool, --max-total-tokens from its share of the GPU (less its weights, over the KV
bytes of a token), which SGLang takes as a cap: the pool is min(profiled, N)
(_resolve_memory_pool_config -> _apply_token_constraints). Its --mem-fraction-static then only has
to let that start-up check pass while the others load (`profile_fraction`); nothing else reads it
once it is given (server_args._handle_gpu_memory_settings derives chunked prefill and the CUDA
graph batch sizes from the GPU's total memory, not from it). Where the GPU's memory or the
target's weights are unknown, the servers of a GPU start one after another, each sizing its
own pool.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import UserError
from draftlab.sglang.loading import config_dtype

# servers_per_gpu "auto": by the bytes of the target's weights on disk (bf16: 2 bytes per parameter).
# Under 2 GB (< ~1B parameters) the scheduler is the limit; up to 8 GB two servers still pay; above,
# one server fills the GPU.
AUTO_PER_GPU = ((2e9, 4), (8e9, 2))
DEFAULT_SHARED_MEM = 0.8  # GPU memory share of all the servers on one GPU when several share it and none is given
# Of a server's KV budget (its share of the GPU less its weights), the part made pool tokens; the rest
# covers what SGLang allocates beside the pool from the same budget: the request-to-token table
# (max running requests x context x 4 B: 64 MB for 2048 x 8192), a page of padding, allocator rounding.
KV_MARGIN = 0.9
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
MIB = 1 << 20


@dataclass(frozen=True)
class PlannedServer:
    gpu: str | None  # CUDA_VISIBLE_DEVICES for this server (None: leave the environment as it is)
    mem_fraction: float | None  # --mem-fraction-static (None: SGLang's own choice)
    max_total_tokens: int | None = None  # --max-total-tokens: an explicit KV pool (None: SGLang sizes it when it starts)

    @property
    def explicit(self) -> bool:
        """Whether its KV pool is explicit, so that it may start beside the other servers of its GPU."""
        return self.max_total_tokens is not None

    def args(self) -> list[str]:
        """Its memory flags for SGLang."""
        out = [] if self.mem_fraction is None else ["--mem-fraction-static", str(self.mem_fraction)]
        return out + ([] if self.max_total_tokens is None else ["--max-total-tokens", str(self.max_total_tokens)])


@dataclass(frozen=True)
class Footprint:
    """What one server of the target holds on its GPU besides activations and CUDA graphs (bytes)."""

    weights: int  # the weight files' bytes
    per_token: int  # KV-cache bytes of one token (kv_bytes_per_token)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (empty on a CPU machine)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [g.strip() for g in named.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU to plan for
        return []


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the target's weight files (safetensors, bin, gguf) in its folder; 0 when not a folder."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf") and f.is_file())


def servers_per_gpu(setting: int | str, model_dir: str | Path) -> int:
    """synth.servers_per_gpu: a number as given, or "auto" by the target's weight bytes (AUTO_PER_GPU)."""
    if setting != "auto":
        return int(setting)
    size = weight_bytes(model_dir)
    if size == 0:  # a hub id: its size is unknown here, so one server, as before this setting existed
        return 1
    return next((n for limit, n in AUTO_PER_GPU if size < limit), 1)


def plan_servers(per_gpu: int, gpus: list[str], mem_fraction: float | None, footprint: Footprint | None = None,
                 free_memory=None) -> list[PlannedServer]:
    """One entry per server: `per_gpu` on each GPU of `gpus`, each with mem_fraction / per_gpu of it.

    Several servers on a GPU whose free memory (`free_memory(gpu)`, bytes; gpu_free_memory by
    default) and target (`footprint`) are known get explicit KV pools (`explicit_pool`), so that they
    start together; else each gets --mem-fraction-static mem_fraction / per_gpu and they start one
    after another. On a machine without GPUs (`gpus` empty: the CPU stand-in of tests, or a server
    that finds its device itself) the servers are started with the environment as it is."""
    if per_gpu < 1:
        raise UserError(f"params.yaml: synth.servers_per_gpu must be at least 1, got {per_gpu}")
    share = mem_fraction if mem_fraction is not None else (DEFAULT_SHARED_MEM if per_gpu > 1 else None)
    each = round(share / per_gpu, 4) if share is not None else None
    if each is not None and each < 0.05:
        raise UserError(f"params.yaml: synth.mem_fraction_static {share} shared by {per_gpu} servers per GPU leaves each "
                        f"{each:.3f} of the GPU's memory, too little for weights and a KV cache; raise "
                        f"synth.mem_fraction_static or lower synth.servers_per_gpu")
    free_memory = free_memory or gpu_free_memory
    out = []
    for gpu in gpus or [None]:
        free = free_memory(gpu) if per_gpu > 1 and gpu is not None and footprint is not None else None
        planned = explicit_pool(gpu, share, per_gpu, free, footprint) if free else PlannedServer(gpu, each)
        out += [planned] * per_gpu
    return out


def explicit_pool(gpu: str, share: float, per_gpu: int, free: int, footprint: Footprint) -> PlannedServer:
    """A server of `per_gpu` on `gpu` with an explicit KV pool: its share (share / per_gpu of the `free`
    bytes, as SGLang takes its fraction of the memory free when it starts) less its weights, made
    tokens (KV_MARGIN of it), and the --mem-fraction-static that lets it start beside the others."""
    budget = share / per_gpu * free
    tokens = int((budget - footprint.weights) * KV_MARGIN // footprint.per_token)
    if tokens < 1:
        raise UserError(f"params.yaml: synth.mem_fraction_static {share} shared by {per_gpu} servers on GPU {gpu} leaves each "
                        f"{budget / MIB:.0f} MiB of its {free / MIB:.0f} MiB free, not more than the target's weights "
                        f"({footprint.weights / MIB:.0f} MiB): no room for a KV cache; raise synth.mem_fraction_static or "
                        f"lower synth.servers_per_gpu")
    return PlannedServer(gpu, profile_fraction(share), tokens)


def profile_fraction(static_share: float) -> float:
    """--mem-fraction-static of a server whose pool is explicit, where the servers of its GPU hold
    `static_share` of the memory free (weights and pools together).

    SGLang 0.5.14 reads it, once the pool is explicit, only in its start-up check
    (_profile_available_bytes): the memory free after its weights load, less (1 - f) x the memory
    free when it started, must be positive (and at least its pool, else the pool is cut to what is
    left). While the others load, up to static_share of the memory is theirs and ours, so (1 - f)
    must stay below what they leave: half of it, the other half for their CUDA contexts, graphs
    and activations. 0.8 shared -> 0.9."""
    return round(1.0 - (1.0 - static_share) / 2.0, 3)


def kv_bytes_per_token(info: dict, dtype_bytes: int, tp_size: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU of a server, as SGLang 0.5.14 counts them for an
    MHA/GQA model (pool_configurator.DefaultPoolConfigurator._compute_cell_size: KV heads x (K + V
    head dims) x layers x dtype bytes; KV heads per GPU max(1, heads // tp)). info: num_layers,
    num_key_value_heads, head_dim (draftlab.target.load.target_info). A sliding-window or MLA
    model's cache is smaller than this: the pool is then conservative."""
    heads = max(1, info["num_key_value_heads"] // tp_size)
    return 2 * info["num_layers"] * heads * info["head_dim"] * dtype_bytes


def dtype_bytes(dtype: str, model_dir: str | Path | None = None) -> int:
    """Bytes of one KV-cache element: SGLang keeps the cache in the dtype it serves (--kv-cache-dtype
    auto). dtype: --dtype as given; "auto" is the checkpoint's torch_dtype (4 bytes when unknown)."""
    if dtype == "auto":
        try:
            dtype = str(config_dtype(json.loads((Path(model_dir) / "config.json").read_text()))[1] or "float32")
        except (OSError, TypeError, ValueError, AttributeError):  # no folder, no config, not a JSON object
            dtype = "float32"
    return DTYPE_BYTES.get(dtype.replace("torch.", ""), 4)


def footprint(model_dir: str | Path, info: dict, dtype: str, tp_size: int = 1) -> Footprint | None:
    """The target's Footprint on one GPU of a server (its weights split over tp_size GPUs); None when
    its weights are not in a local folder (a hub id: their size is unknown here)."""
    weights = weight_bytes(model_dir)
    if weights == 0:
        return None
    return Footprint(weights // tp_size, kv_bytes_per_token(info, dtype_bytes(dtype, model_dir), tp_size))


def gpu_free_memory(gpu: str) -> int | None:
    """Bytes free on the GPU that CUDA_VISIBLE_DEVICES calls `gpu` (an index or a UUID), or None
    when it cannot be read: from nvidia-smi, which makes no CUDA context in this process (that
    would hold ~500 MB of the GPU for as long as the stage runs); torch when nvidia-smi is missing."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return int(float(out.split()[0])) * MIB  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    try:
        import torch

        index = visible_gpus().index(gpu)
        return int(torch.cuda.mem_get_info(index)[0]) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch, no driver, or a name torch does not know: unknown
        return None


# SGLang 0.5.14 creates its FlashAttention 3 backend only on compute capability 8.x (not for MLA models)
# or 9.x: create_flashattention_v3_backend asserts "FlashAttention v3 Backend requires SM>=80 and SM<=90"
# (layers/attention/attention_registry.py), after the server has loaded its weights.
FA3_MAJORS = (8, 9)


def compute_capability(gpu: str) -> tuple[str, int, int] | None:
    """(name, major, minor) of the GPU that CUDA_VISIBLE_DEVICES calls `gpu`, from nvidia-smi (no CUDA
    context in this process); None when it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        name, cap = (x.strip() for x in out.strip().splitlines()[0].rsplit(",", 1))
        major, minor = (int(x) for x in cap.split("."))
        return name, major, minor
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_fa3(args: list[str], key: str, gpus: list[str] | None = None, capability=None) -> None:
    """Refuse `--attention-backend fa3` in a server's argument list before it starts on a GPU that SGLang's
    FlashAttention 3 backend refuses (FA3_MAJORS): SGLang says so only in the server's log, after loading
    the weights. `key` names the params key that set the backend. GPUs whose capability cannot be read,
    and an MLA target (DeepSeek, Kimi) on 8.x, which SGLang also refuses, are left to SGLang."""
    if flag_value(args, "--attention-backend") != "fa3":
        return
    for gpu in visible_gpus() if gpus is None else gpus:
        found = (capability or compute_capability)(gpu)
        if found is not None and found[1] not in FA3_MAJORS:
            name, major, minor = found
            raise UserError(f"{key}: --attention-backend fa3 runs on GPUs of compute capability 8.x or 9.0 (A100, H100, H200) "
                            f"in SGLang, but GPU {gpu} is a {name} ({major}.{minor}): choose triton or flashinfer in {key}")


def with_given_pool(planned: PlannedServer, args: list[str], key: str) -> tuple[PlannedServer, list[str]]:
    """(planned, args) once the --max-total-tokens the user gave in `key` (its argument list `args`)
    is settled: a server whose pool is explicit keeps the user's value in place of its own, taken
    out of `args` so that it is passed once, when it is within the server's share; a larger one
    would take memory planned for the other servers of its GPU, and is refused."""
    given = flag_value(args, "--max-total-tokens")
    if given is None or not planned.explicit:
        return planned, list(args)
    tokens = human_int(given, key)
    if tokens > planned.max_total_tokens:
        raise UserError(f"{key}: --max-total-tokens {given} is more than a server's share of GPU {planned.gpu} holds "
                        f"({planned.max_total_tokens} tokens, from synth.mem_fraction_static and synth.servers_per_gpu); "
                        f"lower it or remove it (each server then gets its share), or raise synth.mem_fraction_static")
    return PlannedServer(planned.gpu, planned.mem_fraction, tokens), without_flag(args, "--max-total-tokens")


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in an argument list (`--flag v` or `--flag=v`; the last one, as argparse takes it)."""
    value = None
    for i, item in enumerate(args):
        item = str(item)
        if item == flag and i + 1 < len(args):
            value = str(args[i + 1])
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


def without_flag(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and its value."""
    out, skip = [], False
    for item in args:
        if skip:
            skip = False
        elif str(item) == flag:
            skip = True
        elif not str(item).startswith(flag + "="):
            out.append(item)
    return out


def human_int(text: str, key: str) -> int:
    """A whole number as SGLang's human_readable_int reads it: 65536, 64k, 1.5M, 64Ki."""
    units = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            number, scale = text[:-len(unit)], units[unit]
            break
    else:
        number, scale = text, 1
    try:
        return int(float(number) * scale) if scale > 1 else int(number)
    except ValueError:
        raise UserError(f"{key}: --max-total-tokens {text!r} is not a number of tokens (65536, 64k, 64Ki)") from None


def server_env(planned: PlannedServer, base: dict | None = None) -> dict | None:
    """The environment of one planned server: CUDA_VISIBLE_DEVICES pinned to its GPU."""
    if planned.gpu is None:
        return None if base is None else dict(base)
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = planned.gpu
    return env
