"""Test helpers for Llama-3.2-Vision (Mllama): tiny random checkpoints that can fail, prompts with tiled images
as HF's image processor makes them, HF references, and our model driven over the paged KV with its
per-request cross-attention state filled as the worker fills it.

`build_tiny_mllama(path)` saves weights + config (vocabulary of 128; `<|image|>` is id 128, inside the embedding
table's 8 extra rows as in Meta's checkpoints); `make_tiny_mllama_checkpoint(path)` writes a complete
checkpoint directory (tokenizer with `<|image|>`, MllamaImageProcessor + MllamaProcessor, a chat template) for
processor and server tests.

Fixtures that can fail (shared/design/FAMILY-FIXTURES.md): RMSNorm weights are random, the cross-attention gates
are far from transformers' zero init (tanh(0) = 0 would hide the images), the projector is rescaled so the
vision states are text-sized, and the layer counts are odd (cross-attention layers at 1 and 3 of 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.processors.mllama import CROSS_SPAN, RATIO_ID, RATIO_MASK, cross_attention_spans
from tests.models.fixture_checks import save_random_model
from tests.models.paged_driver import PagedKV, Step, make_batch

VOCAB, IMAGE_ID, TILE, MAX_TILES = 128, 128, 28, 4


def tiny_mllama_config(vocab_size: int = VOCAB, image_token_index: int = IMAGE_ID, **text: Any):
    from transformers import MllamaConfig

    return MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_global_layers=1,
                           attention_heads=2, image_size=TILE, patch_size=14, max_num_tiles=MAX_TILES,
                           intermediate_layers_indices=[1], vision_output_dim=64, norm_eps=1e-5),
        text_config=dict(vocab_size=vocab_size, hidden_size=48, intermediate_size=72, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, **{"cross_attention_layers": [1, 3], **text},
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64},
                         max_position_embeddings=512, rms_norm_eps=1e-5),
        image_token_index=image_token_index)


def make_fixture_can_fail_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ("layernorm" in name and name.endswith("weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.fill_(0.9 if "attn_gate" in name else -0.7)
            elif name.endswith("gate") and "vision_model" in name:  # the tower's gated embeddings
                p.fill_(0.5)
            elif "cross_attn." in name and name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(6.0)  # the images' share of the residual stream as large as the text's
        proj = model.model.multi_modal_projector
        proj.weight.mul_(0.12)  # vision states as large as the text embeddings
        model.lm_head.weight.mul_(4.0)  # sharper logits: greedy choices well above float noise


def build_tiny_mllama(path: Path, seed: int = 0, **config: Any):
    from transformers import MllamaForConditionalGeneration

    cfg = tiny_mllama_config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **config})
    return save_random_model(path, MllamaForConditionalGeneration, cfg, seed,
                             lambda m: make_fixture_can_fail_(m, seed))


def load_hf_reference(path: Path):
    from transformers import MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()


def image_processor():
    from transformers import MllamaImageProcessor

    return MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)


def random_image(h: int, w: int, g: torch.Generator):
    from PIL import Image

    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


@dataclass
class Prompt:
    input_ids: torch.Tensor
    items: list[MultimodalDataItem]
    hf_images: dict = field(default_factory=dict)  # HF's image processor output for the prompt's images

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def build_prompt(parts: list, seed: int = 0) -> Prompt:
    """parts: ints (that many random text ids < 100) and ("image", h, w) (an `<|image|>` token and a random
    h x w image); items as our processor makes them (HF's image processor, spans from the ids)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(3, 100, (part,), generator=g).tolist()
        else:
            ids.append(IMAGE_ID)
            images.append(random_image(part[1], part[2], g))
    if not images:
        return Prompt(torch.tensor(ids), [])
    out = image_processor()([images], return_tensors="pt")
    spans = cross_attention_spans(ids, IMAGE_ID)
    items = [MultimodalDataItem(Modality.IMAGE, hash(("mllama", seed, i, tuple(ids))), [],
                                feature=out["pixel_values"][0, i].clone(),
                                model_specific_data={RATIO_ID: out["aspect_ratio_ids"][0, i].clone(),
                                                     RATIO_MASK: out["aspect_ratio_mask"][0, i].clone(),
                                                     CROSS_SPAN: torch.tensor(span)})
             for i, span in enumerate(spans)]
    return Prompt(torch.tensor(ids), items, {k: out[k] for k in ("pixel_values", "aspect_ratio_ids",
                                                                  "aspect_ratio_mask")} | {"num_tiles": out["num_tiles"]})


def hf_inputs(prompt: Prompt) -> dict:
    """HF's forward kwargs: its processor's cross_attention_mask from the ids (HF's own functions)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    ids = prompt.input_ids.tolist()
    inputs = {"input_ids": prompt.input_ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if prompt.items:
        mask = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(ids, IMAGE_ID)],
                                                            prompt.hf_images["num_tiles"], MAX_TILES, len(ids))
        inputs.update(pixel_values=prompt.hf_images["pixel_values"],
                      aspect_ratio_ids=prompt.hf_images["aspect_ratio_ids"],
                      aspect_ratio_mask=prompt.hf_images["aspect_ratio_mask"],
                      cross_attention_mask=torch.as_tensor(mask))
    return inputs


def hf_logits(hf, prompt: Prompt) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**hf_inputs(prompt)).logits[0]


def hf_greedy(hf, prompt: Prompt, num_new: int) -> tuple[list[int], float]:
    """transformers' own greedy generate (no stop token) and its smallest top-2 logit margin."""
    with torch.inference_mode():
        out = hf.generate(**hf_inputs(prompt), max_new_tokens=num_new, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    top = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), float((top[:, 0] - top[:, 1]).min())


# ---------------------------------------------------------------- our model over the paged KV

class Driver:
    """Requests of our model over one paged KV: each request's cross-attention state filled once from its items
    through the family's RequestState (slots of a row of their own, as the KVManager holds them), and every
    batch given the state of its requests, as the worker gives it."""

    def __init__(self, model, page_size: int = 1, num_pages: int = 4096):
        self.model = model
        self.kv = PagedKV(model.config, page_size=page_size, num_pages=num_pages, max_reqs=16, max_context_len=1024)
        self.state: dict[int, tuple[torch.Tensor, Any]] = {}

    def new_request(self, prompt: Prompt) -> int:
        row = self.kv.new_request()
        rs = type(self.model).request_state
        n = rs.extra_slots(self.model.config, prompt.items)
        if n:
            slots = self.kv.extend(self.kv.new_request(), n)
            with torch.inference_mode():
                states = torch.cat(self.model.get_image_feature(prompt.items))
                rs.fill(self.model, [states], [slots], self.kv.pool)
            self.state[row] = (slots, rs.layout(self.model.config, prompt.items))
        return row

    def forward(self, steps: list[Step]) -> torch.Tensor:
        fb = make_batch(self.kv, steps)
        held = [self.state.get(s.row, (torch.zeros(0, dtype=torch.long), None)) for s in steps]
        lens = [int(s.shape[0]) for s, _ in held]
        table = torch.zeros(len(steps), max(lens), dtype=torch.long)
        for b, (s, _) in enumerate(held):
            table[b, :s.shape[0]] = s
        fb.state_slots, fb.state_lens, fb.state_layouts = table, lens, [lay for _, lay in held]
        with torch.inference_mode():
            return self.model(fb, self.kv.pool)

    def prefill(self, rows: list[int], prompts: list[Prompt], chunk: int | None = None) -> list[torch.Tensor]:
        """Every prompt prefilled together, in chunks of at most `chunk` tokens each step; per prompt the logits
        of all its tokens."""
        done = [0] * len(rows)
        out: list[list[torch.Tensor]] = [[] for _ in rows]
        while any(d < len(p) for d, p in zip(done, prompts)):
            steps, which = [], []
            for i, (r, p) in enumerate(zip(rows, prompts)):
                if done[i] < len(p):
                    hi = len(p) if chunk is None else min(len(p), done[i] + chunk)
                    steps.append(Step(r, p.input_ids[done[i]:hi], torch.arange(done[i], hi), all_logits=True))
                    which.append((i, hi - done[i]))
                    done[i] = hi
            logits = self.forward(steps).split([n for _, n in which])
            for (i, _), lo in zip(which, logits):
                out[i].append(lo)
        return [torch.cat(o) for o in out]

    def greedy(self, prompts: list[Prompt], num_new: int, chunk: int | None = None,
               ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """All prompts prefilled together, then decoded together: (tokens per prompt, prefill logits)."""
        rows = [self.new_request(p) for p in prompts]
        logits = self.prefill(rows, prompts, chunk)
        last = [lo[-1] for lo in logits]
        tokens: list[list[int]] = [[] for _ in rows]
        for _ in range(num_new):
            for t, lo in zip(tokens, last):
                t.append(int(lo.argmax()))
            last = list(self.forward([Step(r, torch.tensor([t[-1]]), torch.tensor([self.kv.lens[r]]))
                                      for r, t in zip(rows, tokens)]))
        return tokens, logits


# ---------------------------------------------------------------- full checkpoint directory

# A short Llama-3.2-Vision-style template: `<|image|>` for each image part, in place (no BOS: the processor puts
# it first, as HF's MllamaProcessor does).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIAL = ("<|begin_of_text|>", "<|image|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|python_tag|>")


def make_tiny_mllama_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Writes a complete random Mllama checkpoint to `path` and returns it: demo-vl's tokenizer with Llama-3.2's
    special tokens (BOS `<|begin_of_text|>`, `<|image|>`), an MllamaImageProcessor of 28-pixel tiles (at most 4)
    + MllamaProcessor with a chat template, and config + model.safetensors made to be able to fail."""
    from transformers import AutoTokenizer, GenerationConfig, MllamaProcessor

    from tessera.config import ASSETS_DIR

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl")
    tok.add_special_tokens({"bos_token": SPECIAL[0], "extra_special_tokens": list(SPECIAL[1:])})
    tok.image_token = "<|image|>"  # demo-vl names its own (Qwen's <|image_pad|>); MllamaProcessor reads this one
    MllamaProcessor(image_processor=image_processor(), tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    eos, pad = ids["<|eot_id|>"], tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_tiny_mllama(path, seed, vocab_size=(len(tok) + 63) // 64 * 64, image_token_index=ids["<|image|>"],
                              pad_token_id=pad, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.generation_config.save_pretrained(path)
    return path
