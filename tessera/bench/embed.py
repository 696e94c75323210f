"""`tessera bench embed`: embeddings per second through tessera.Engine.encode against transformers' own forward,
in one run, on the same inputs: N short texts (the demo scenes' captions) and M images (rendered scenes, each
with a short instruction, chat-templated).

HF runs the base model (`model.model`, the final-norm hidden states the pooler reads) in fp32 two ways: one
input per forward, and padded batches of --hf-batch-size (right padding with an attention mask; the last
prompt token of each row pooled). Both sides pool the last token and L2-normalise, and the vectors are
compared (the smallest cosine similarity is reported), so the work measured is the same. Each side gets
untimed warm-up calls first: HF a few inputs (its batched pass runs after its one-at-a-time pass, warm by
then), the Engine a batch of the measured size of other captions and scenes, its caches flushed afterwards
(the first large batch of a fresh engine paid ~100 ms of one-time costs; the flush keeps the warm-up's prompt
prefixes out of the measured batch). The Engine batches on its own (all inputs submitted at once).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

IMAGE_PROMPT = "Describe the image."


@dataclass
class EmbedBenchResult:
    model: str
    num_texts: int
    num_images: int
    tessera_texts_per_s: float
    tessera_images_per_s: float
    hf_one_texts_per_s: float
    hf_one_images_per_s: float
    hf_batched_texts_per_s: float
    hf_batched_images_per_s: float
    hf_batch_size: int
    min_cosine: float  # the least similar pair of Tessera's and HF's vectors

    def summary(self) -> str:
        rows = [("texts", self.num_texts, self.tessera_texts_per_s, self.hf_one_texts_per_s,
                 self.hf_batched_texts_per_s),
                ("images", self.num_images, self.tessera_images_per_s, self.hf_one_images_per_s,
                 self.hf_batched_images_per_s)]
        lines = [f"embeddings/s on {self.model} (HF batches of {self.hf_batch_size}; min cosine vs HF "
                 f"{self.min_cosine:.6f})",
                 f"{'input':<8}{'n':>6}{'tessera':>10}{'hf one':>10}{'hf batch':>10}{'x one':>8}{'x batch':>9}"]
        for name, n, ours, one, batch in rows:
            lines.append(f"{name:<8}{n:>6}{ours:>10.1f}{one:>10.1f}{batch:>10.1f}{ours / one:>8.2f}"
                         f"{ours / batch:>9.2f}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def inputs(num_texts: int, num_images: int, seed: int = 0) -> tuple[list[str], list]:
    from tessera.demo import scenes

    rng = random.Random(seed)
    texts = [scenes.describe(scenes.random_scene(rng)) for _ in range(num_texts)]
    images = [scenes.render(scenes.random_scene(rng)) for _ in range(num_images)]
    return texts, images


class HFEmbedder:
    """transformers' base model, last token pooled and normalised, one input or a padded batch per forward."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch = torch
        self.processor = AutoProcessor.from_pretrained(model_path)
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()

    def image_prompt(self) -> str:
        content = [{"type": "image"}, {"type": "text", "text": IMAGE_PROMPT}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=False, tokenize=False)

    def embed(self, texts: list[str], images: list | None = None) -> list:
        torch = self.torch
        tok = self.processor.tokenizer
        tok.padding_side = "right"
        with torch.inference_mode():
            if images:
                enc = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
            else:
                enc = tok(texts, return_tensors="pt", padding=True)
            hidden = self.model.model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(dim=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last]
            return list(torch.nn.functional.normalize(pooled, dim=-1))

    def run(self, texts: list[str], images: list, batch_size: int) -> tuple[list, list]:
        prompt = self.image_prompt()
        text_out: list = []
        for i in range(0, len(texts), batch_size):
            text_out += self.embed(texts[i:i + batch_size])
        image_out: list = []
        for i in range(0, len(images), batch_size):
            part = images[i:i + batch_size]
            image_out += self.embed([prompt] * len(part), part)
        return text_out, image_out


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run_embed_bench(model_path: str = "demo-vl", num_texts: int = 256, num_images: int = 64,
                    hf_batch_size: int = 32, engine_kwargs: dict | None = None) -> EmbedBenchResult:
    import torch

    from tessera.entrypoints.engine import Engine
    from tessera.config import resolve_model_path

    texts, images = inputs(num_texts, num_images)
    warm_texts, warm_images = inputs(num_texts, num_images, seed=1)
    with Engine(model_path, show_progress=False, **(engine_kwargs or {})) as engine:
        engine.encode(warm_texts)
        engine.encode([IMAGE_PROMPT] * len(warm_images), image_data=warm_images)
        engine.flush_cache()
        t_texts, ours_t = _timed(lambda: engine.encode(texts))
        t_images, ours_i = _timed(lambda: engine.encode([IMAGE_PROMPT] * len(images), image_data=images))
    hf = HFEmbedder(resolve_model_path(model_path))
    hf.run(texts[:2], images[:1], 1)
    hf_one_t, (ref_t, _) = _timed(lambda: hf.run(texts, [], 1))
    hf_one_i, (_, ref_i) = _timed(lambda: hf.run([], images, 1))
    hf_b_t, _ = _timed(lambda: hf.run(texts, [], hf_batch_size))
    hf_b_i, _ = _timed(lambda: hf.run([], images, hf_batch_size))
    ours = [torch.tensor(o["embedding"]) for o in [*ours_t, *ours_i]]  # type: ignore[union-attr]
    min_cos = min(float(torch.dot(a, b)) for a, b in zip(ours, [*ref_t, *ref_i]))
    return EmbedBenchResult(model_path, num_texts, num_images, num_texts / t_texts, num_images / t_images,
                            num_texts / hf_one_t, num_images / hf_one_i, num_texts / hf_b_t, num_images / hf_b_i,
                            hf_batch_size, min_cos)
