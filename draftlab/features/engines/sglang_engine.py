"""extract.engine sglang: the target run by SGLang's own ModelRunner in this process, on this
process's GPU, tensor-parallel over extract.tp_size ranks: the kernels (and their rounding) the
draft will be served with.

Written against SGLang 0.5.14 (sglang/srt/model_executor/model_runner.py, managers/schedule_batch.py,
model_executor/forward_batch_info.py); no scheduler and no HTTP server. What it relies on
(docs/scale.md):
- ModelRunner's constructor sets up its distributed groups and loads the weights; alloc_memory_pool(),
  init_attention_backends() and init_cuda_graphs() must then be called (the last builds the eager
  runner forward() uses; CUDA graphs are off: disable_cuda_graph).
- The model's set_eagle3_layers_to_capture(ids) makes its forward hand `aux_hidden_states` (one
  [tokens, H] tensor per captured layer, ascending) to its LogitsProcessor, together with the final
  hidden states after the norm, for every token of an extend batch (chunked prefill off).
- One extend batch of Reqs: ScheduleBatch.init_new + prepare_for_extend (0.5.14 leaves the tokens on
  the host, in prefill_input_ids_cpu: moved to the GPU here, as the scheduler's worker does),
  ForwardBatch.init_new, ModelRunner.forward; then the pools are cleared for the next batch.
All of the above ran on one H100 with SGLang 0.5.14 (SmolLM2-135M, triton attention; benchmarks/
engine_capture.py, reports/engine-capture/). Any of it failing is an error naming extract.engine, never
a silent fallback to transformers.

The KV pool holds one capture's tokens and is sized for them (max_tokens: the most tokens one capture
call holds, given by the caller), not SGLang's default share of the GPU, which would take the memory
that online training and its state cache need beside it. A call holding more is run in parts.
"""
from __future__ import annotations

import importlib.util
import socket
from array import array

import torch

from draftlab.errors import UserError
from draftlab.parallel import RankLayout

WRITTEN_FOR = "0.5.14"


def _require(device: str, layout: RankLayout | None) -> None:
    """Refuse, before loading anything, what this engine cannot run on."""
    if importlib.util.find_spec("sglang") is None:
        raise UserError("extract.engine sglang: SGLang is not installed in this environment; install sglang "
                        f"{WRITTEN_FOR} (its GPU wheel) or set extract.engine transformers")
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise UserError("extract.engine sglang needs a CUDA device (SGLang's kernels are GPU-only) and target.device "
                        f"resolved to {device!r}; run on a GPU or set extract.engine transformers")
    if layout is not None and layout.dp_size > 1:
        # SGLang's initialize_model_parallel requires the torch world to be exactly tp_size x pp_size:
        # several engines in one torchrun would need their groups made by hand (SpecForge patches
        # parallel_state for it). Until that is written and run on GPUs, one engine per launch.
        raise UserError(f"extract.engine sglang runs one engine per launch: launch exactly extract.tp_size "
                        f"({len(layout.tp_ranks)}) processes, not {layout.dp_size * len(layout.tp_ranks)}; "
                        "split the rows over launches or use extract.engine transformers for data parallelism")


def _free_port() -> int:
    """The engine's NCCL port. Not draftlab.sglang.launch.free_port (below the OS's ephemeral
    range, what servers started together need): the features part of the DAG may not import the
    serving part, and one engine in one process starts nothing beside it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parts(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices in consecutive groups of at most `capacity` tokens in all: one forward each, so
    the KV pool (capacity tokens) holds every group. A row longer than the pool is an error."""
    groups, used = [[]], 0
    for j, n in enumerate(lengths):
        if n > capacity:
            raise UserError(f"extract.engine sglang: a row of {n} tokens does not fit the engine's KV pool of {capacity} "
                            "tokens; lower extract.max_length or raise extract.engine_args.max_total_tokens")
        if used + n > capacity:
            groups.append([])
            used = 0
        groups[-1].append(j)
        used += n
    return [g for g in groups if g]


class _Recorder(torch.nn.Module):
    """Stands in for the model's LogitsProcessor: keeps what the model hands it (every token's final
    hidden state and the captured layers), then runs it as usual (logits of the last tokens only)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.got = inner, None

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        self.got = (hidden_states, aux_hidden_states)
        return self.inner(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)


class SGLangEngine:
    name = "sglang"

    def __init__(self, runner, recorder: _Recorder, config, tokenizer, architecture: str, version: str, layer_ids):
        self.runner, self.recorder, self.config, self.tokenizer = runner, recorder, config, tokenizer
        self.architecture, self.version, self.layer_ids, self.layers = architecture, version, layer_ids, None

    @classmethod
    def load(cls, target_params, extract_params, device: str, layout: RankLayout | None, layer_ids,
             max_tokens: int | None = None) -> "SGLangEngine":
        _require(device, layout)
        if layer_ids is None:
            raise UserError("extract.engine sglang: no layer-id rule given (draftlab.sglang.layers.ids_for_physical)")
        import sglang
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        from draftlab.target.load import load_config, load_tokenizer, model_path

        tp_size = extract_params.tp_size
        tp_rank = layout.tp_rank if layout is not None else 0
        if layout is not None and len(layout.tp_ranks) != tp_size:
            raise UserError(f"extract.tp_size {tp_size} but this process's group has {len(layout.tp_ranks)} ranks")
        pool = {"max_total_tokens": max_tokens} if max_tokens else {}  # extract.engine_args may set its own
        try:
            args = ServerArgs(**{**pool, **dict(getattr(extract_params, "engine_args", {}) or {})},
                              model_path=model_path(target_params.model), revision=target_params.revision,
                              dtype=target_params.dtype, tp_size=tp_size, pp_size=1,
                              disable_cuda_graph=True,  # every batch has its own shape
                              chunked_prefill_size=-1)  # one forward per row: every token's states at once
        except TypeError as e:  # a field this SGLang's ServerArgs does not have
            raise UserError(f"extract.engine_args: SGLang {sglang.__version__}'s ServerArgs refused them ({e}); "
                            "give only ServerArgs fields (sglang/srt/server_args.py)") from None
        runner = ModelRunner(model_config=ModelConfig.from_server_args(args), mem_fraction_static=args.mem_fraction_static,
                             gpu_id=torch.device(device).index or 0, tp_rank=tp_rank, tp_size=tp_size, moe_ep_rank=0,
                             moe_ep_size=1, pp_rank=0, pp_size=1, nccl_port=_free_port(), server_args=args)
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()  # builds the eager runner forward() uses (no graph is captured: disable_cuda_graph)
        found = [(n, m) for n, m in runner.model.named_modules() if isinstance(m, LogitsProcessor) and n]
        if len(found) != 1:
            raise UserError(f"extract.engine sglang: expected one LogitsProcessor in SGLang's {type(runner.model).__name__}, "
                            f"found {len(found)}; this target is not supported by the sglang engine")
        name, inner = found[0]
        parent, _, child = name.rpartition(".")
        recorder = _Recorder(inner)
        setattr(runner.model.get_submodule(parent) if parent else runner.model, child, recorder)
        config = load_config(target_params)
        tok = load_tokenizer(target_params.model, target_params.revision)
        architecture = (config.architectures or [""])[0]
        return cls(runner, recorder, config, tok, architecture, sglang.__version__, layer_ids)

    def _set_layers(self, physical: list[int]) -> None:
        """SGLang's ids for `physical`, by the per-family rule the caller passed (draftlab.sglang.layers.
        ids_for_physical: DeepSeek-V2/V3 and Kimi take a first id 1 as +1, others as-is; the rest +1)."""
        if self.layers == sorted(physical):
            return
        num_layers = getattr(self.config.get_text_config(), "num_hidden_layers")
        ids = self.layer_ids(self.architecture, num_layers, physical, self.version)
        hook = getattr(self.runner.model, "set_eagle3_layers_to_capture", None)
        if hook is None:
            raise UserError(f"extract.engine sglang: SGLang's {type(self.runner.model).__name__} has no "
                            "set_eagle3_layers_to_capture; this target cannot be captured through SGLang")
        hook(ids)
        self.layers = sorted(physical)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, physical: list[int]):
        """({physical index: [B, T, H]}, final hidden [B, T, H]) of right-padded rows (padding rows zero),
        in as many forwards as the KV pool needs."""
        self._set_layers(physical)
        lengths = attention_mask.sum(dim=1).tolist()
        layers, final = None, None
        for rows in parts(lengths, self.runner.max_total_num_tokens):
            aux, last = self._forward([input_ids[j, : lengths[j]].tolist() for j in rows])
            if len(aux) != len(physical) or last.shape[0] != sum(lengths[j] for j in rows):
                raise UserError(f"extract.engine sglang: got {len(aux)} captured layers of {last.shape[0]} tokens, "
                                f"expected {len(physical)} of {sum(lengths[j] for j in rows)}")
            if final is None:
                layers = [last.new_zeros(*input_ids.shape, a.shape[-1]) for a in aux]
                final = last.new_zeros(*input_ids.shape, last.shape[-1])
            for dest, flat in zip(layers + [final], aux + [last]):
                for j, piece in zip(rows, torch.split(flat, [lengths[j] for j in rows])):
                    dest[j, : len(piece)] = piece
        return dict(zip(sorted(physical), layers)), final

    def _forward(self, rows: list[list[int]]):
        """One extend batch of token rows: (the captured layers, each [tokens, H] ascending; the final
        post-norm states [tokens, H]), the rows end to end."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner, reqs = self.runner, []
        for j, ids in enumerate(rows):
            req = Req(rid=str(j), origin_input_text="", origin_input_ids=ids,
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
            req.full_untruncated_fill_ids = array("q", req.origin_input_ids)
            req.fill_len = len(req.full_untruncated_fill_ids)
            req.extend_input_len = req.fill_len - len(req.prefix_indices)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        cache = RadixCache(CacheInitParams(disable=True, req_to_token_pool=runner.req_to_token_pool,
                                           token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                           page_size=runner.server_args.page_size))
        try:
            batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                           token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=cache,
                                           model_config=runner.model_config, enable_overlap=False,
                                           spec_algorithm=SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            if getattr(batch, "input_ids", None) is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                # 0.5.14 leaves the extend tokens on the host; the scheduler's worker moves them before forward
                batch.input_ids = batch.prefill_input_ids_cpu.to(runner.device, non_blocking=True)
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            self.recorder.got = None
            runner.forward(ForwardBatch.init_new(batch, runner))
            if self.recorder.got is None or self.recorder.got[1] is None:
                raise UserError("extract.engine sglang: the forward did not hand the captured layers to the logits "
                                "processor; this SGLang release or target is not supported by the sglang engine")
            final, aux = self.recorder.got
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
        return list(aux), final

    def close(self) -> None:
        self.runner = self.recorder = None
