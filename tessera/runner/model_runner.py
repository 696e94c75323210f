"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the model, samples.

Owns the model, the KV memory (token pool, slot table, page allocator, radix cache) and the
encoder cache. Media are encoded once per distinct item (by content hash); the embedding
rows that fall inside this step's chunk are scattered at their token rows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.encoder_cache import EncoderCache
from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from tessera.cache.radix_cache import RadixCache
from tessera.config import ServerArgs
from tessera.multimodal.items import Modality, MultimodalDataItem
from tessera.runner.forward_batch import ForwardBatch
from tessera.runner.sampler import Sampler, SamplingBatchInfo
from tessera.scheduler.batch import ScheduledBatch, ScheduledReq

logger = logging.getLogger("tessera.runner")


@dataclass
class StepOutput:
    sampled: list[ScheduledReq]  # the requests that produced a token, in order
    next_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def _eos_ids(model_path: str, hf_config) -> set[int]:
    ids: set[int] = set()
    gen = Path(model_path) / "generation_config.json"
    cands = [json.loads(gen.read_text()).get("eos_token_id")] if gen.exists() else []
    text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    cands.append(getattr(text_cfg, "eos_token_id", None))
    for c in cands:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list):
            ids.update(int(x) for x in c)
    return ids


class ModelRunner:
    def __init__(self, args: ServerArgs):
        from transformers import AutoTokenizer

        from tessera.models.registry import load_model

        self.args = args
        self.device = torch.device(args.device)
        self.model, self.hf_config = load_model(args.model_path, dtype=args.torch_dtype,
                                                language_model_only=args.language_model_only,
                                                attention_backend=args.attention_backend, device=self.device)
        self.model.eval()
        text_cfg = self.hf_config.get_text_config()
        self.vocab_size = int(text_cfg.vocab_size)
        self.context_length = args.context_length or int(text_cfg.max_position_embeddings)
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        size = args.max_total_tokens // args.page_size * args.page_size
        self.kv_pool = TokenToKVPool(size, text_cfg.num_hidden_layers, text_cfg.num_key_value_heads, head_dim,
                                     dtype=args.torch_dtype, device=self.device)
        self.req_pool = ReqToTokenPool(args.max_running_requests + 1, self.context_length + 8, device=self.device)
        self.allocator = PagedTokenAllocator(size, args.page_size, device=self.device)
        self.tree = RadixCache(self.allocator, args.page_size, disable=args.disable_radix_cache)
        self.encoder_cache = EncoderCache(args.mm_cache_size_mb * 1024 * 1024, args.keep_mm_feature_on_device)
        self.sampler = Sampler(seed=args.random_seed)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.eos_token_ids = _eos_ids(args.model_path, self.hf_config)

    # ---- multimodal ---------------------------------------------------------------------------
    def _item_embedding(self, item: MultimodalDataItem, stash: dict[int, torch.Tensor]) -> torch.Tensor | None:
        if item.precomputed_embedding is not None:
            return item.precomputed_embedding
        if item.hash in stash:
            return stash[item.hash]
        emb = self.encoder_cache.get(item.hash)
        if emb is not None:
            stash[item.hash] = emb
        return emb

    def _encode_missing(self, items: list[MultimodalDataItem], stash: dict[int, torch.Tensor]) -> None:
        """Runs the encoder once for all items of the step that no cache holds, one call per modality."""
        by_modality: dict[Modality, list[MultimodalDataItem]] = {}
        seen: set[int] = set()
        for it in items:
            if it.hash not in seen:
                seen.add(it.hash)
                by_modality.setdefault(it.modality, []).append(it)
        encoders = {Modality.IMAGE: "get_image_feature", Modality.VIDEO: "get_video_feature",
                    Modality.AUDIO: "get_audio_feature"}
        for modality, group in by_modality.items():
            fn = getattr(self.model, encoders[modality], None)
            if fn is None:
                raise ValueError(f"{modality.value}: this model has no {modality.value} encoder")
            for it, emb in zip(group, fn(group)):
                if emb.shape[0] != it.num_tokens:
                    raise ValueError(f"{modality.value}: encoder gave {emb.shape[0]} embeddings for "
                                     f"{it.num_tokens} placeholder tokens")
                stash[it.hash] = emb
                self.encoder_cache.put(it.hash, emb)

    def _mm_embeds(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        plan: list[tuple[int, MultimodalDataItem, int, int, dict]] = []  # (flat row, item, item row lo, hi, stash)
        missing: list[MultimodalDataItem] = []
        flat = 0
        for s in batch.reqs:
            req, mm = s.req, s.req.mm_inputs
            if mm is not None and mm.items and s.start < len(req.origin_input_ids):
                for item in mm.items:
                    item_row = 0
                    for lo, hi in item.offsets:
                        a, b = max(lo, s.start), min(hi, s.end)
                        if a < b:
                            if self._item_embedding(item, req.mm_embed_stash) is None:
                                missing.append(item)
                            plan.append((flat + a - s.start, item, item_row + a - lo, item_row + b - lo,
                                         req.mm_embed_stash))
                        item_row += hi - lo
            flat += s.end - s.start
        if not plan:
            return None, None
        if missing:
            stashes = {id(p[4]): p[4] for p in plan}
            merged: dict[int, torch.Tensor] = {}
            self._encode_missing(missing, merged)
            for st in stashes.values():
                st.update({h: e for h, e in merged.items()})
        rows, embeds = [], []
        for row, item, lo, hi, stash in plan:
            emb = self._item_embedding(item, stash)
            rows.append(torch.arange(row, row + hi - lo))
            # Move each slice before concatenating: encoder-cache entries live on the host
            # (unless --keep-mm-feature-on-device) and precomputed embeddings arrive there,
            # while fresh encoder outputs are on the device; torch.cat refuses such a mix.
            embeds.append(emb[lo:hi].to(self.device))
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    # ---- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> StepOutput:
        ids: list[int] = []
        positions, locs, logits_rows, sampled = [], [], [], []
        flat = 0
        for s in batch.reqs:
            ids.extend(s.req.fill_ids[s.start : s.end])
            positions.append(s.req.positions(s.start, s.end))
            locs.append(s.out_cache_loc)
            flat += s.end - s.start
            if s.samples:
                logits_rows.append(flat - 1)
                sampled.append(s)
        mm_rows, mm_embeds = self._mm_embeds(batch)
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions, dim=1).to(dev),
            out_cache_loc=torch.cat(locs).to(dev),
            req_pool_indices=torch.tensor([s.req.req_pool_idx for s in batch.reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor([s.end for s in batch.reqs], dtype=torch.int64, device=dev),
            extend_lens=torch.tensor([s.end - s.start for s in batch.reqs], dtype=torch.int64, device=dev),
            req_to_token=self.req_pool.req_to_token,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            mm_embed_rows=mm_rows, mm_embeds=mm_embeds,
            req_generations=None if self.args.disable_decode_kv_mirror else
            [self.req_pool.generation[s.req.req_pool_idx] for s in batch.reqs],
        )
        for s in batch.reqs:  # embeddings are only needed until the prompt's KV exists
            if s.end >= len(s.req.origin_input_ids):
                s.req.mm_embed_stash.clear()
        if not sampled:
            self.model(fb, self.kv_pool)
            return StepOutput([], [], None, None)
        logits = self.model(fb, self.kv_pool).float()
        reqs = [s.req for s in sampled]
        info = SamplingBatchInfo.build([r.sampling_params for r in reqs], logits.shape[-1],
                                       [r.output_ids for r in reqs], [r.origin_input_ids for r in reqs],
                                       eos_token_ids=self.eos_token_ids, device=dev)
        out = self.sampler(logits, info)
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top = None
        if out.top_logprob_ids is not None:
            ids_l, vals_l = out.top_logprob_ids.tolist(), out.top_logprob_values.tolist()
            top = [list(zip(ids_l[i][: r.sampling_params.top_logprobs_num], vals_l[i][: r.sampling_params.top_logprobs_num]))
                   for i, r in enumerate(reqs)]
        return StepOutput(sampled, next_ids, logprobs, top)
