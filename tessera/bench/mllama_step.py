"""Prefill and decode step of an Mllama (Llama-3.2-Vision) shaped model, ours vs HF's, on random weights.

    python -m tessera.bench.mllama_step [--batch-size 8] [--context-len 256] [--steps 10] [--threads N]

The text model is bench-medium's size (width 768, 12 layers, GQA 12/4; tessera/bench/medium.py) with
cross-attention layers at 3 and 8, the vision tower 4 + 2 global layers of width 384 over 112-pixel tiles
(65 states per tile, 4 tiles per image: 260 cross-attention K/V rows per image). Measured, medians:
- prefill: one request, one 2 x 2-tile image and `--context-len` text tokens after it: ours (vision tower,
  projector, the cross-attention state's fill, the prompt over the paged pool) vs HF's forward with pixels;
- decode: `--batch-size` requests, one image each, `--context-len` tokens of KV: one token per request, ours
  over the paged pool and each request's state vs HF's with its cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

TEXT = dict(vocab_size=32000, hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, cross_attention_layers=[3, 8], pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=4, num_global_layers=2, attention_heads=6,
              image_size=112, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[1, 3],
              vision_output_dim=1152)
IMAGE_ID = 32000


def build(path: Path):
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(0)
    cfg = MllamaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE_ID)
    hf = MllamaForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in hf.model.language_model.layers:  # open gates: the images take part in the products' values
            for name in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
                if hasattr(layer, name):
                    getattr(layer, name).fill_(0.5)
    hf.save_pretrained(path)
    return hf


def image_item(seed: int):
    """One 2 x 2-tile image at the prompt's start, attending to the whole prompt (a processor item's fields)."""
    from tessera.messages.items import Modality, MultimodalDataItem
    from tessera.multimodal.processors.mllama import CROSS_SPAN, RATIO_ID, RATIO_MASK

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(4, 3, VISION["image_size"], VISION["image_size"], generator=g)
    return MultimodalDataItem(Modality.IMAGE, seed, [], feature=pixels, model_specific_data={
        RATIO_ID: torch.tensor(6), RATIO_MASK: torch.ones(4, dtype=torch.long), CROSS_SPAN: torch.tensor([0, -1])})


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class Ours:
    """Our model over a pool with contiguous slots per request (the cost does not depend on where they are)."""

    def __init__(self, path: Path, batch: int, context: int, steps: int):
        from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
        from tessera.models.registry import load_model

        self.model, self.config = load_model(path, torch.float32)
        self.state = type(self.model).request_state
        rows = self.state.extra_slots(self.config, [image_item(0)])
        self.span = context + steps + 8
        kv = self.config.kv_layout
        self.pool = TokenToKVPool(batch * (self.span + rows) + 1, kv.num_layers, kv.num_kv_heads, kv.head_dim)
        self.req = ReqToTokenPool(batch, self.span)
        self.req.req_to_token[:] = 1 + torch.arange(batch * self.span).view(batch, self.span)
        self.state_slots = 1 + batch * self.span + torch.arange(batch * rows).view(batch, rows)
        self.lens = [0] * batch

    def fill(self, items) -> list:
        with torch.inference_mode():
            states = self.model.get_image_feature(items)
            self.state.fill(self.model, states, list(self.state_slots[:len(items)]), self.pool)
        return [self.state.layout(self.config, [it]) for it in items]

    def forward(self, ids: list[torch.Tensor], layouts: list) -> torch.Tensor:
        from tessera.layers.forward_batch import ForwardBatch

        b = len(ids)
        ext = [int(t.shape[0]) for t in ids]
        starts = self.lens[:b]
        seq = [s + n for s, n in zip(starts, ext)]
        fb = ForwardBatch(
            input_ids=torch.cat(ids), positions=torch.cat([torch.arange(s, e) for s, e in zip(starts, seq)]),
            out_cache_loc=torch.cat([self.req.req_to_token[i, s:e] for i, (s, e) in enumerate(zip(starts, seq))]),
            req_pool_indices=torch.arange(b), seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext),
            req_to_token=self.req.req_to_token, host_seq_lens=seq, host_extend_lens=ext,
            host_req_pool_indices=list(range(b)), state_slots=self.state_slots[:b],
            state_lens=[int(self.state_slots.shape[1])] * b, state_layouts=layouts)
        with torch.inference_mode():
            out = self.model(fb, self.pool)
        self.lens[:b] = seq
        return out


def run(batch: int, context: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf = build(path)
        ours = Ours(path, batch, context, steps)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.cat([torch.tensor([IMAGE_ID]), torch.randint(3, 30000, (context - 1,), generator=g)])
               for _ in range(batch)]
    items = [image_item(i) for i in range(batch)]

    def hf_kwargs(n: int, rows: int):
        return dict(pixel_values=torch.stack([it.feature for it in items[:n]])[:, None],
                    aspect_ratio_ids=torch.full((n, 1), 6), aspect_ratio_mask=torch.ones(n, 1, 4, dtype=torch.long),
                    cross_attention_mask=torch.ones(n, rows, 1, 4, dtype=torch.long))

    def ours_prefill():
        ours.lens[0] = 0
        ours.forward([prompts[0]], ours.fill(items[:1]))

    def hf_prefill():
        with torch.inference_mode():
            hf(input_ids=prompts[0][None], **hf_kwargs(1, context))

    result = {"prefill_ms": median_ms(ours_prefill, 5), "hf_prefill_ms": median_ms(hf_prefill, 5)}
    ours.lens = [0] * batch
    layouts = ours.fill(items)
    ours.forward(prompts, layouts)
    with torch.inference_mode():
        out = hf(input_ids=torch.stack(prompts), **hf_kwargs(batch, context), use_cache=True)
    cache, token = out.cache, torch.full((batch, 1), 5)
    mask = torch.ones(batch, 1, 1, 4, dtype=torch.long)

    def ours_step():
        ours.forward(list(token), layouts)

    def hf_step():
        nonlocal cache
        with torch.inference_mode():
            cache = hf(input_ids=token, cache=cache, cross_attention_mask=mask, use_cache=True).cache

    result.update(decode_ms=median_ms(ours_step, steps), hf_decode_ms=median_ms(hf_step, steps))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    r = run(ns.batch_size, ns.context_len, ns.steps)
    print(f"prefill (1 image + {ns.context_len} tokens): tessera {r['prefill_ms']:.1f} ms, HF {r['hf_prefill_ms']:.1f} ms")
    print(f"decode step (batch {ns.batch_size}, context {ns.context_len}): tessera {r['decode_ms']:.1f} ms, "
          f"HF {r['hf_decode_ms']:.1f} ms")


if __name__ == "__main__":
    main()
