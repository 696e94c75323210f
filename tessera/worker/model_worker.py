"""ModelWorker: owns the model, the KV pool (and its copy of the slot table) and the encoder-output cache;
runs one ForwardInput per step and returns the sampled tokens.

Everything it needs arrives in the ForwardInput; it never reads scheduler state. Media are encoded once
per distinct item (by content hash, shared through the encoder cache); an item's embedding is held for its
request from the first prefill chunk that needs it until the prompt's KV is complete.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tessera.cache.encoder_cache import EncoderCache
from tessera.cache.kv_pool import TokenToKVPool, kv_pool_tokens
from tessera.cache.state_pool import build_state_pool
from tessera.config import ServerArgs
from tessera.distributed.encoder_dp import dp_sharded_encode
from tessera.distributed.parallel_state import min_over_ranks, tp_group
from tessera.layers import half_linear
from tessera.layers.linear import count_parameters
from tessera.layers.attention import uses_decode_mirror
from tessera.models.config import ModelConfig
from tessera.models.mm_embed import EmbeddingCountError
from tessera.models.registry import load_model
from tessera.models.request_state import padded_slot_table
from tessera.multimodal.materialize import materializer_for
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.layers.forward_batch import ForwardBatch
from tessera.worker.draft_model import DraftModel
from tessera.worker.encode_ahead import EncodeAhead
from tessera.worker.sampler import Sampler
from tessera.worker.step_launch import OutputLauncher, StepHandle, resolve_placeholders
from tessera.worker.cuda_graph import (DEFAULT_LORA_RANK, DecodeGraphRunner, DecodeInputs, capture_batch_sizes,
                                      capture_decode_graphs, decode_graphs_off, graph_max_bs)
from tessera.messages.worker import ForwardInput, StepOutput, WorkerInfo
from tessera.platform import cpu_kernels, host_memory
from tessera.platform.device import (compute_dtype, platform_of, rank_device, resolve_device, resolve_dtype,
                                     to_device_packed)
from tessera.worker.lora_step import build_lora, by_adapter, encode_by_adapter, lora_active, lora_backend, lora_rows
from tessera.worker.masks import span_mask
from tessera.worker.slot_writes import apply_slot_writes, slot_write_parts
from tessera.worker.pooling import Pooler, hidden_rows
from tessera.worker.prompt_logprobs import extra_logits_rows

logger = logging.getLogger("tessera.worker")

# Items per encoder call on a CPU when the thread policy is adaptive (see _encode).
CPU_ENCODE_CHUNK = 8
# Items per encode-ahead call: a request is held until the call with its last item ends, so larger calls hold the
# first requests for the later ones' images (demo-vl, waves of 16 image requests: the slowest first token 389-498
# ms with 1, 554-616 with 8), and the tower's per-item cost does not depend on the call's size (see _encode).
ENCODE_AHEAD_CHUNK = 1
# Items the encode-ahead thread queues or holds, per running request the server admits.
ENCODE_AHEAD_ITEMS_PER_REQUEST = 4
class ModelWorker:
    def __init__(self, args: ServerArgs, eos_token_ids: set[int], config: ModelConfig | None = None):
        """Joins nothing itself: under tensor parallelism the group is initialised before (tp_launch)."""
        self.args = args
        self.tp = tp_group()
        self.device = resolve_device(args.device)
        if self.tp.size > 1 or args.base_gpu_id:
            self.device = rank_device(self.device, args.base_gpu_id + self.tp.rank)  # one accelerator per rank
        self.platform = platform_of(self.device)
        self.platform.bind(self.device)
        self.clock = self.platform.step_clock()  # device busy / idle between steps, for get_server_info
        # Built (or found in the cache) once, before the first step; what did not load is in the report.
        self.cpu_kernels = cpu_kernels.load() if self.platform.runs_on_host_cores else {}
        self.model, self.config = load_model(args.model_path, dtype=args.dtype, device=self.device,
                                             language_model_only=args.language_model_only,
                                             attention_backend=args.attention_backend, config=config,
                                             torchao_config=args.torchao_config)
        # The weights' dtype (what --dtype asked for) and the dtype the model computes in, which the KV pool
        # and the step's tensors take: float32 for 16-bit weights on a CPU (Platform.computes_16bit).
        self.weight_dtype = resolve_dtype(args.dtype, self.config.dtype, self.device)
        self.dtype = compute_dtype(self.weight_dtype, self.device)
        self.linear_kernel = (half_linear.describe(self.weight_dtype) if self.weight_dtype != self.dtype
                              else f"{str(self.dtype).removeprefix('torch.')} weights and compute")
        logger.info("weights %s, compute %s: %s", str(self.weight_dtype).removeprefix("torch."),
                    str(self.dtype).removeprefix("torch."), self.linear_kernel)
        backend_name = self.model.attn_backend.name  # what load_model resolved `auto` to (it needs the dtype)
        self.context_length = args.context_length or self.config.max_position_embeddings
        layout = self.model.kv_layout
        bytes_per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
        # Hybrid models' per-request state: a slot per request-table row, allocated before the device's free
        # memory is read, so the KV budget is what the states leave.
        state_pool = build_state_pool(self.model.state_layout, args.max_running_requests + 2, self.dtype, self.device)
        mem_info = self.platform.memory_info(self.device)
        weight_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        size = min_over_ranks(kv_pool_tokens(args, bytes_per_token, mem_info, weight_bytes, self.context_length),
                              self.device)  # ranks must agree
        # The pool holds K/V in the model's dtype (bfloat16 models: half the bytes of float32); the bytes per
        # token reported below are read from its buffers, so a pool that kept another dtype shows.
        self.kv_pool = TokenToKVPool(size, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                     dtype=self.dtype, device=self.device)
        self.kv_pool.state = state_pool
        # The worker's copy of the slot table, kept equal to the scheduler's by ForwardInput.slot_writes. The
        # scheduler uses rows 0..max_running_requests; the last row is never a request's: it stays all slot 0
        # (the dummy), for the padding rows of CUDA-graph batches.
        self.req_to_token = torch.zeros((args.max_running_requests + 2, self.context_length + 8),
                                        dtype=torch.int64, device=self.device)
        self.pad_row = args.max_running_requests + 1
        self.lora = build_lora(args, self.model, self.config, self.dtype, self.device)  # None: no --enable-lora
        self.encoder_cache = EncoderCache(args.mm_cache_size_mb * 1024 * 1024, args.keep_mm_feature_on_device)
        self.encoders = self.model.encoders()
        self.ahead: EncodeAhead | None = None  # start_encode_ahead
        self._encoder_lock = threading.Lock()
        # Images the frontend sent as raw pixels are preprocessed here, by whichever rank encodes them.
        self.materialize = None if args.language_model_only else materializer_for(
            args.tokenizer_path or args.model_path, self.config.hf_config, self.config.family.processor_class(),
            self.device)
        self.use_decode_mirror = not args.disable_decode_kv_mirror and uses_decode_mirror(self.device)
        self._held: dict[str, dict[int, torch.Tensor]] = {}  # rid -> item hash -> embedding
        self.pooler = Pooler()  # embedding requests' partial pools across prefill chunks
        self._pooled_hidden: torch.Tensor | None = None  # the last step's hidden rows for the pooler
        self.previous_ids: torch.Tensor | None = None  # the last step's sampled ids (device), for placeholders
        # Called between the parts of a long step (encoder chunks, then the language model): the scheduler's
        # CPU thread policy (platform/threads.py) re-decides there, so a step that began while the frontend was busy
        # does not keep one core when that core frees up. None: nothing to call.
        self.between_phases: Callable[[], object] | None = None
        # The family's per-request state (models/request_state.py; None: it keeps none), and each request's
        # slots of it (device): rid -> slots, from fill to release.
        self.request_state = type(self.model).request_state
        self._state_slots: dict[str, tuple[torch.Tensor, Any]] = {}  # rid -> (slots, RequestState.layout)
        # STANDALONE speculative decoding's draft model (rank 0 proposes; scheduler/speculative.py verifies).
        self.draft_proposer: DraftModel | None = None
        if args.speculative_algorithm == "STANDALONE" and self.tp.rank == 0:
            self.draft_proposer = DraftModel(args, self.device, self.context_length, self.config.vocab_size,
                                             rows=min(args.max_running_requests, 2 * args.speculative_disable_by_batch_size))
        self.outputs = OutputLauncher(Sampler(seed=args.random_seed), self.pooler, eos_token_ids, self.device,
                                      self.model.process_logits, self.platform)  # a step's sampling and read-back
        self.cuda_graph_status = ""  # set by _capture_decode_graphs
        self.graph_runner = self._capture_decode_graphs(backend_name)
        if self.platform.runs_on_host_cores:  # after the weights loaded: their staging copies are not kept
            host_memory.keep_freed_blocks()
        self.info = WorkerInfo(device=str(self.device), dtype=str(self.weight_dtype).removeprefix("torch."),
                               compute_dtype=str(self.dtype).removeprefix("torch."), linear_kernel=self.linear_kernel,
                               max_total_tokens=size, kv_bytes_per_token=self.kv_pool.bytes_per_token,
                               context_length=self.context_length, vocab_size=self.config.vocab_size,
                               attention_backend=backend_name, decode_kv_mirror=self.use_decode_mirror,
                               tp_size=self.tp.size,
                               num_parameters=count_parameters(self.model, self.tp.size),
                               cuda_graph_batch_sizes=tuple(self.graph_runner.sizes) if self.graph_runner else (),
                               cpu_kernels=self.cpu_kernels, cuda_graph_status=self.cuda_graph_status,
                               quantization=self.model.quantization, lora_backend=lora_backend(self.lora))

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def decode_graph_runner(self, max_bs: int) -> DecodeGraphRunner:
        """A runner of padded decode steps over this worker's model, pool and slot table (not captured)."""
        return DecodeGraphRunner(self.model, self.kv_pool, self.req_to_token, capture_batch_sizes(max_bs),
                                 self.pad_row, self.config.positions == "mrope", lora=self.lora,
                                 compile_max_bs=self.args.torch_compile_max_bs if self.args.enable_torch_compile else 0)

    def _capture_decode_graphs(self, backend_name: str) -> DecodeGraphRunner | None:
        """The decode graphs, or None (every step then runs eagerly); sets cuda_graph_status."""
        why_not = decode_graphs_off(self.args, self.platform, self.model, backend_name, self.request_state is not None,
                                    self.tp.size)
        if why_not is None and self.lora is not None:  # the graphs replay the stacks' addresses: fixed from here on
            self.lora.fix_stacks(self.args.max_lora_rank or DEFAULT_LORA_RANK)
        runner, self.cuda_graph_status = (None, f"off: {why_not}") if why_not else capture_decode_graphs(
            self.decode_graph_runner(graph_max_bs(self.args)), self.platform, self.device)
        return runner

    def lora_adapter(self, name: str, path: str | None) -> None:
        """Loads adapter `name` from `path` onto the host (None: unloads it); AdapterError when it cannot."""
        if self.lora is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if path is None:
            self.lora.remove(name)
        else:
            self.lora.add(name, path)

    # ---- cache control ---------------------------------------------------------------------------
    def flush_cache(self) -> None:
        self.encoder_cache.clear()
        if self.ahead is not None:
            self.ahead.clear()

    def cache_stats(self) -> tuple[int, int, int]:
        """Encoder cache (hits, misses, bytes)."""
        c = self.encoder_cache
        return c.hits, c.misses, c.used_bytes

    # ---- media -----------------------------------------------------------------------------------
    def _mm_embeds(self, fi: ForwardInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of the step's media placeholders and their embeddings (from media_embeddings); each
        request's embeddings are held until its prompt's KV exists (a later chunk needs the rest of them)."""
        if not fi.mm_placements:
            return None, None
        first = {}  # item index -> its first placement: an item is looked up once however many it has
        for p in fi.mm_placements:
            first.setdefault(p.item, p)
        found = dict(zip(first, self.media_embeddings(
            [fi.mm_items[i] for i in first], [self._held.get(fi.rids[p.req], {}) for p in first.values()])))
        rows, embeds = [], []
        for p in fi.mm_placements:
            emb = found[p.item]
            self._held.setdefault(fi.rids[p.req], {})[fi.mm_items[p.item].hash] = emb
            rows.append(torch.arange(p.row, p.row + p.hi - p.lo))
            # Slices move one by one: cached entries live on the host (pinned on CUDA; unless
            # --keep-mm-feature-on-device) while fresh encoder outputs are on the device, and torch.cat
            # refuses such a mix.
            embeds.append(emb[p.lo:p.hi].to(self.device, non_blocking=True))
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def media_embeddings(self, items: Sequence[MultimodalDataItem], held: Sequence[dict[int, torch.Tensor]] = (),
                         per_placeholder: bool = True) -> list[torch.Tensor]:
        """The encoder output of each item, the first found of: its precomputed embedding, its request's held
        one (`held`, per item: hash -> embedding), the encoder cache, the encode-ahead thread's; the rest are
        encoded now, each distinct item once (_encode). per_placeholder: an encoded item's rows must match its
        placeholder tokens (a family whose outputs fill per-request state checks them there instead)."""
        out: list[torch.Tensor | None] = []
        missing: dict[int, MultimodalDataItem] = {}  # hash -> the first such item
        for k, item in enumerate(items):
            emb = item.precomputed_embedding
            if emb is None and k < len(held):
                emb = held[k].get(item.hash)
            if emb is None:
                emb = self.encoder_cache.get(item.hash)
            if emb is None and self.ahead is not None:
                emb = self.ahead.take(item.hash)
                if emb is not None:
                    self.encoder_cache.put(item.hash, emb)
            if emb is None:
                missing.setdefault(item.hash, item)
            out.append(emb)
        if missing:
            encoded = self._encode(list(missing.values()), per_placeholder)
            out = [emb if emb is not None else encoded[item.hash] for emb, item in zip(out, items)]
        return out  # type: ignore[return-value]

    def _encode(self, items: list[MultimodalDataItem], per_placeholder: bool) -> dict[int, torch.Tensor]:
        """Encodes distinct items, one encoder call per modality; hash -> embedding, each put in the cache."""
        by_modality: dict[Modality, list[MultimodalDataItem]] = {}
        for item in items:
            by_modality.setdefault(item.modality, []).append(item)
        out: dict[int, torch.Tensor] = {}
        for modality, items in by_modality.items():
            if self.args.mm_enable_dp_encoder and self.tp.size > 1:  # each rank encodes a share, then all_gather
                embeds = dp_sharded_encode(self._encoder_for(modality), items, [it.num_tokens for it in items],
                                           self.dtype, self.device)
                if per_placeholder:
                    self._check_counts(items, embeds)
            elif self.between_phases is not None and self.platform.runs_on_host_cores and self.tp.size == 1:
                # Chunks of a few items, the thread count re-decided before each: a CPU tower's per-item cost
                # does not depend on the call's size (demo-vl's tower over 64 images: 0.669 / 0.684 / 0.711 s
                # in calls of 16 / 29 / 64), while one call over a step's 50 images takes most of a second. One
                # rank only: tensor-parallel ranks each encode every item and must see the same numbers.
                embeds = []
                for i in range(0, len(items), CPU_ENCODE_CHUNK):
                    self.between_phases()
                    embeds.extend(self._encode_items(items[i : i + CPU_ENCODE_CHUNK], per_placeholder))
            else:
                embeds = self._encode_items(items, per_placeholder)
            for item, emb in zip(items, embeds):
                self.encoder_cache.put(item.hash, emb)
                out[item.hash] = emb
        return out

    def _encoder_for(self, modality: Modality) -> Callable[[list[MultimodalDataItem]], list[torch.Tensor]]:
        encoder = self.encoders.get(modality)
        if encoder is None:
            raise ValueError(f"{modality.value}: this model has no {modality.value} encoder")
        if self.materialize is not None:
            return lambda items: encoder(self.materialize(items))
        return encoder

    def _encode_items(self, items: list[MultimodalDataItem], per_placeholder: bool = True) -> list[torch.Tensor]:
        """One encoder call over items of one modality, each output checked against its placeholder count
        (unless not per_placeholder). One call at a time: the step's and the encode-ahead thread's share the
        towers (and their plan caches)."""
        with self._encoder_lock:
            embeds = encode_by_adapter(self.lora, items, self._encoder_for(items[0].modality))
        if per_placeholder:
            self._check_counts(items, embeds)
        return embeds

    @staticmethod
    def _check_counts(items: list[MultimodalDataItem], embeds: list[torch.Tensor]) -> None:
        for item, emb in zip(items, embeds):
            if emb.shape[0] != item.num_tokens:
                raise EmbeddingCountError(f"{item.modality.value}: encoder gave {emb.shape[0]} embeddings for "
                                          f"{item.num_tokens} placeholder tokens")

    # ---- encoding ahead (see worker/encode_ahead.py) ---------------------------------------------------
    def start_encode_ahead(self) -> bool:
        """Starts the encode-ahead thread where it applies: one rank, a model with encoders, TESSERA_ENCODE_AHEAD
        not 0. The scheduler calls this on a device (the thread's kernels on a side stream) and on host cores
        when its thread policy can leave the thread a core (adaptive threads); returns whether it runs."""
        if (self.ahead is None and self.tp.size == 1 and self.encoders
                and os.environ.get("TESSERA_ENCODE_AHEAD", "1") != "0"):
            self.ahead = EncodeAhead(self._encode_items, ENCODE_AHEAD_CHUNK,
                                     capacity=ENCODE_AHEAD_ITEMS_PER_REQUEST * self.args.max_running_requests,
                                     budget_bytes=self.args.mm_cache_size_mb * 1024 * 1024,
                                     side=self.platform.side_stream(self.device),
                                     host_cores=self.platform.runs_on_host_cores)
            self.info = dataclasses.replace(self.info, encode_ahead=True)
        return self.ahead is not None

    def encode_ahead(self, items: Sequence[MultimodalDataItem]) -> None:
        """Queues a newly arrived request's media for the encode-ahead thread (nothing when it is not running):
        the items with an encoder that are neither precomputed nor in the encoder cache."""
        if self.ahead is None:
            return
        todo = [it for it in items if it.precomputed_embedding is None and it.modality in self.encoders
                and it.hash not in self.encoder_cache]
        if todo:
            self.ahead.submit(todo)

    def media_ready(self, items: Sequence[MultimodalDataItem]) -> bool:
        """Whether a step needing `items` would find none of them still being encoded ahead."""
        return self.ahead is None or all(self.ahead.ready(it.hash) for it in items)

    def background_cores(self) -> int:
        """Cores this worker's own background work holds now (the thread policy leaves them free)."""
        return 1 if self.ahead is not None and self.ahead.busy else 0

    def _fill_request_state(self, fi: ForwardInput) -> tuple[torch.Tensor, list[int], list] | None:
        """Writes the per-request state of newly admitted requests (from their items' media_embeddings, checked
        against the rows the state takes) and returns every request's state:
        (slots [B, max extra_slots], padded with slot 0; each request's count; each request's layout). A request
        that keeps no state (count 0) attends to nothing. None when the family keeps no such state."""
        if self.request_state is None:
            return None
        if fi.state_fills:
            items = [it for fill in fi.state_fills for it in fill.items]
            outputs = dict(zip((it.hash for it in items), self.media_embeddings(items, per_placeholder=False)))
            fills = fi.state_fills
            states = [torch.cat([outputs[it.hash] for it in f.items]) if len(f.items) > 1 else outputs[f.items[0].hash]
                      for f in fills]
            for f, out in zip(fills, states):
                rows = self.request_state.extra_slots(self.config, f.items)
                if out.shape[0] != rows:
                    raise EmbeddingCountError(f"encoder outputs have {out.shape[0]} rows, the model's per-request "
                                              f"state takes {rows}")
            slots = [fill.slots.to(self.device) for fill in fills]
            # An adapter on cross-attention's K/V projections (Whisper's) applies to its own requests' fills.
            with self._encoder_lock:
                by_adapter(self.lora, [f.items[0].lora_name for f in fills], lambda idx: self.request_state.fill(
                    self.model, [states[i] for i in idx], [slots[i] for i in idx], self.kv_pool))
            for fill, s in zip(fills, slots):
                self._state_slots[fi.rids[fill.req]] = (s, self.request_state.layout(self.config, fill.items))
        empty = (torch.zeros(0, dtype=torch.int64, device=self.device), None)
        held = [self._state_slots.get(rid, empty) for rid in fi.rids]
        table = padded_slot_table([s for s, _ in held], self.device)
        return table, [int(s.shape[0]) for s, _ in held], [layout for _, layout in held]

    def _custom_masks(self, fi: ForwardInput) -> list[torch.Tensor | None] | None:
        if fi.bidirectional_spans is None:
            return None
        masks = [span_mask(spans, seq - ext, seq, self.device)
                 for spans, seq, ext in zip(fi.bidirectional_spans, fi.seq_lens, fi.extend_lens)]
        return masks if any(m is not None for m in masks) else None

    def _graph_bucket(self, fi: ForwardInput, masks: list[torch.Tensor | None] | None) -> int | None:
        """The CUDA-graph bucket of a pure decode step (one token per request, each sampled, no media, no
        custom mask); None when the step runs eagerly."""
        if self.graph_runner is None or fi.mm_placements or masks is not None or fi.state_fills or \
                fi.prompt_logprob_rows or fi.pooling_rows:
            return None
        if fi.num_tokens != len(fi.seq_lens) or fi.logits_rows != list(range(fi.num_tokens)):
            return None
        return self.graph_runner.bucket_for(fi.num_tokens, fi.positions)

    # ---- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fi: ForwardInput) -> torch.Tensor:
        """The step's model forward: its logits [len(fi.logits_rows) + prompt logprob rows, vocab]."""
        for rid in fi.released:
            self._held.pop(rid, None)
            self._state_slots.pop(rid, None)
            self.pooler.release(rid)
        writes = slot_write_parts(fi)
        (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, extend_lens, logits_rows,
         *staged_writes) = to_device_packed(
            [_int64(p) for p in (fi.input_ids, fi.positions, fi.out_cache_loc, fi.req_pool_indices, fi.seq_lens,
                                 fi.extend_lens, fi.logits_rows + extra_logits_rows(fi.prompt_logprob_rows),
                                 *writes)], self.device)
        if fi.placeholders:  # overlap scheduling: the previous step's tokens, read on the device
            input_ids = resolve_placeholders(input_ids, self.previous_ids)
        apply_slot_writes(self.req_to_token, fi, staged_writes)
        masks = self._custom_masks(fi)
        mm_rows, mm_embeds = self._mm_embeds(fi)
        state = self._fill_request_state(fi)
        if mm_embeds is not None and self.between_phases is not None:
            self.between_phases()
        for rid in fi.prompt_done:  # embeddings are only needed until the prompt's KV exists
            self._held.pop(rid, None)
        bucket = self._graph_bucket(fi, masks)
        if bucket is not None and self.graph_runner is not None:  # adapters too: each row's slot is an input
            lora_slots = self.lora.step.row_slots if lora_active(self.lora) else None  # type: ignore[union-attr]
            return self.graph_runner.forward(DecodeInputs(input_ids, positions, out_cache_loc, req_pool_indices,
                                                          seq_lens, fi.seq_lens, lora_slots), bucket)
        fb = ForwardBatch(
            input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, extend_lens=extend_lens,
            req_to_token=self.req_to_token, logits_indices=logits_rows,
            mm_embed_rows=mm_rows, mm_embeds=mm_embeds, custom_masks=masks,
            # A verify step's rows share their request's table row: the mirror, one row per request, sits it out.
            req_generations=fi.req_generations if self.use_decode_mirror and
            len(set(fi.req_pool_indices)) == len(fi.req_pool_indices) else None,
            host_seq_lens=fi.seq_lens, host_extend_lens=fi.extend_lens, host_req_pool_indices=fi.req_pool_indices,
            state_slots=None if state is None else state[0], state_lens=None if state is None else state[1],
            state_layouts=None if state is None else state[2], lora_rows=lora_active(self.lora),
            hidden_indices=_int64(hidden_rows(fi.pooling_rows)).to(self.device) if fi.pooling_rows else None,
        )
        logits = self.model(fb, self.kv_pool)
        self._pooled_hidden = fb.hidden_states
        return logits

    @torch.inference_mode()
    def device_times(self) -> tuple[float, float]:
        return self.clock.times()

    def idle(self) -> None:
        self.clock.idle()

    def execute(self, fi: ForwardInput) -> StepOutput:
        return self.collect(self.launch(fi))

    def launch(self, fi: ForwardInput) -> StepHandle:
        """Queues the step (forward, sampling) and starts reading its tokens back (worker/step_launch.py); on
        a CPU it has run when this returns. The clock brackets the queuing: on CUDA its events time the run."""
        self.clock.begin()
        try:
            with lora_rows(self.lora, fi):  # the step's adapters in their slots, its rows per slot
                logits = self.forward(fi)
            if self.tp.rank != 0:  # only rank 0 samples
                return StepHandle(StepOutput([]))
            handle, self.previous_ids = self.outputs.launch(fi, logits, self._pooled_hidden)
            self._pooled_hidden = None
            return handle
        finally:
            self.clock.end()

    def collect(self, handle: StepHandle) -> StepOutput:
        """The launched step's output, once its tokens are on the host."""
        return handle.result()


def _int64(part: torch.Tensor | list[int]) -> torch.Tensor:
    """A step input as an int64 host tensor (the messages carry tensors or lists of ints)."""
    return part.to(torch.int64) if isinstance(part, torch.Tensor) else torch.tensor(part, dtype=torch.int64)
