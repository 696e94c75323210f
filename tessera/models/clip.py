"""CLIP (transformers' CLIPModel): a dual encoder served for embeddings only.

A request is a text or one image. A text runs through the text tower (causal self-attention over the prompt,
learned absolute positions, the final layer norm, the hidden state at the end-of-text token) and the text
projection: `CLIPModel.get_text_features`. An image is one placeholder token whose "embedding" is the vision
tower's projected CLS output (`get_image_features`), computed by the worker's encoder call and merged at that
row. Either way the request's last row of the step's [T, projection_dim] output holds its vector, which the
pooler ("last" pooling, always: the model pools by its own rule) normalises (unless asked not to).

The towers are transformers' own modules, filled by our weight loader. The paged KV pool is not used: a
request is computed whole in one step (the scheduler keeps its tokens together, the prefix cache is off).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.forward_batch import ForwardBatch
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder, TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.weights import WeightMapping

_TEXT = "transformers.models.clip.modeling_clip:CLIPTextModel"
_VISION = "transformers.models.clip.modeling_clip:CLIPVisionModel"


class CLIPModel(TesseraModel):
    """forward(fb, pool) fills fb.hidden_states (each request's vector at its last row); no logits. SigLIP
    (models/siglip.py) is a subclass: its towers end in their own heads instead of projections."""

    text_tower_class: ClassVar[str] = _TEXT
    vision_tower_class: ClassVar[str] = _VISION
    has_projections: ClassVar[bool] = True  # CLIP's text_projection / visual_projection after the towers

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__()
        self.config = config
        hf = config.hf_config
        self.projection_dim = config.embedding_size
        self.text_model = build_transformers_tower(self.text_tower_class, hf.text_config)
        self.text_projection = self.visual_projection = None
        if self.has_projections:
            self.text_projection = nn.Linear(int(hf.text_config.hidden_size), self.projection_dim, bias=False)
        self.vision_model = None
        if not language_model_only:
            self.vision_model = build_transformers_tower(self.vision_tower_class, hf.vision_config)
            if self.has_projections:
                self.visual_projection = nn.Linear(int(hf.vision_config.hidden_size), self.projection_dim,
                                                   bias=False)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """transformers' names; logit_scale and logit_bias (the contrastive loss's) are not used."""
        vision = None if language_model_only else "vision_model."
        projection = None if language_model_only else "visual_projection."
        return WeightMapping(prefix_rules=(("text_model.", "text_model."), ("text_projection.", "text_projection."),
                                           ("vision_model.", vision), ("visual_projection.", projection),
                                           ("logit_scale", None), ("logit_bias", None)),
                             ignore=(r"position_ids$",))

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_model is None else {Modality.IMAGE: self.get_image_feature}

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One [1, projection_dim] vector per item: the vision tower over all the call's images at once."""
        assert self.vision_model is not None
        weight = self.text_model.embeddings.token_embedding.weight
        out: list[torch.Tensor | None] = [item.precomputed_embedding for item in items]
        todo = [i for i, e in enumerate(out) if e is None]
        if todo:
            pixels = torch.cat([_pixels(items[i], i) for i in todo]).to(device=weight.device, dtype=weight.dtype)
            pooled = self.vision_model(pixel_values=pixels).pooler_output
            if self.visual_projection is not None:
                pooled = self.visual_projection(pooled)
            for i, v in zip(todo, pooled):
                out[i] = v[None]
        return [e.to(weight.dtype) for e in out]  # type: ignore[union-attr]

    def text_features(self, input_ids: list[torch.Tensor]) -> torch.Tensor:
        """get_text_features of each prompt [B, projection_dim]: one padded call, prompts left-aligned (the
        tower is causal, so the padding after a prompt does not change it)."""
        n = max(int(t.shape[0]) for t in input_ids)
        ids = torch.zeros((len(input_ids), n), dtype=torch.int64, device=input_ids[0].device)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(input_ids):
            ids[i, :t.shape[0]], mask[i, :t.shape[0]] = t, 1
        pooled = self.text_model(input_ids=ids, attention_mask=mask).pooler_output
        return pooled if self.text_projection is None else self.text_projection(pooled)

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        ext, _, starts, _ = fb.host_plan()
        out = torch.zeros((fb.input_ids.shape[0], self.projection_dim),
                          dtype=self.text_model.embeddings.token_embedding.weight.dtype, device=fb.input_ids.device)
        media = set(fb.mm_embed_rows.tolist()) if fb.mm_embed_rows is not None else set()
        texts = [(s, n) for s, n in zip(starts, ext) if s not in media]
        if texts:
            vectors = self.text_features([fb.input_ids[s:s + n] for s, n in texts])
            out[torch.tensor([s + n - 1 for s, n in texts], device=out.device)] = vectors
        if fb.mm_embed_rows is not None and fb.mm_embeds is not None:
            out[fb.mm_embed_rows] = fb.mm_embeds.to(out.dtype)
        if fb.hidden_indices is not None:
            fb.hidden_states = out[fb.hidden_indices]
        rows = fb.logits_indices
        return out.new_zeros((0 if rows is None else int(rows.shape[0]), 1))  # nothing is ever sampled


def _pixels(item: MultimodalDataItem, index: int) -> torch.Tensor:
    if item.feature is None:
        raise ValueError(f"item {index}: neither feature nor precomputed_embedding is set")
    pixels = item.feature if item.feature.ndim == 4 else item.feature[None]
    if pixels.ndim != 4 or pixels.shape[0] != 1:
        raise ValueError(f"item {index}: CLIP takes one image's pixel values [3, S, S], got "
                         f"{tuple(item.feature.shape)}")
    return pixels
