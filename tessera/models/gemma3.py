"""Gemma-3 (`Gemma3ForConditionalGeneration`, and text-only `Gemma3ForCausalLM`): our Gemma decoder over the paged KV cache + transformers'
SigLIP vision tower + our multi-modal projector.

Each image (and each pan-and-scan crop) is one square tower input; the projector average-pools its patch grid
down to mm_tokens_per_image tokens, applies Gemma's RMSNorm and projects to the text width. An item is one
image with its crops: model_specific_data["num_crops"] crops after the original, (1 + num_crops) x
mm_tokens_per_image placeholder tokens in that many runs (the processor's offsets).

Attention inside each run of image tokens is bidirectional during prefill (the family row sets
bidirectional_mm_spans): TesseraModel.prepare_step hands each request's runs to the worker, which builds
causal + span masks (worker/masks.py), and the scheduler never splits a run across prefill chunks nor lets a
cached prefix end inside one, so a chunk that holds an image's queries holds all of its keys. Sliding layers
apply their window on top (transformers: AND(window, OR(causal, block))). Decoding is causal, as in HF.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.layers.gemma_decoder import GEMMA3_OPTIONS, Gemma3TextModel, GemmaRMSNorm
from tessera.models.base import Encoder
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.mm_embed import merge_mm_embeddings
from tessera.models.weights import WeightMapping
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.layers.forward_batch import ForwardBatch


class Gemma3MultiModalProjector(nn.Module):
    """Tower patches [N, p*p, Dv] -> [N, mm_tokens_per_image, D]: average-pool the p x p patch grid to
    t x t tokens (t = sqrt(mm_tokens_per_image)), Gemma RMSNorm, then x @ mm_input_projection_weight."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hf = config.hf_config
        vision = hf.vision_config
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        self.tokens_per_side = int(int(hf.mm_tokens_per_image) ** 0.5)
        if self.tokens_per_side**2 != int(hf.mm_tokens_per_image) or self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={hf.mm_tokens_per_image} must be a square whose side divides "
                             f"image_size / patch_size = {self.patches_per_side}")
        kernel = self.patches_per_side // self.tokens_per_side
        self.avg_pool = nn.AvgPool2d(kernel_size=kernel, stride=kernel)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(int(vision.hidden_size), config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(int(vision.hidden_size), float(vision.layer_norm_eps))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(n, width, self.patches_per_side, self.patches_per_side)
        pooled = self.avg_pool(grid.contiguous()).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3ForCausalLM(CausalLM):
    """Text-only Gemma-3 (`Gemma3ForCausalLM`, model_type gemma3_text: gemma-3-1b); checkpoint names `model.*`,
    `lm_head.*`. Soft-caps the final logits where the config says so, as transformers' class does."""

    decoder_options = GEMMA3_OPTIONS
    decoder_model_class = Gemma3TextModel


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The worker encodes images with get_image_feature (or takes them from its encoder cache) and puts the
    embedding rows of this step's image tokens into fb.mm_embed_rows / fb.mm_embeds."""

    vision_tower_class: ClassVar[str] = "transformers.models.siglip.modeling_siglip:SiglipVisionModel"
    # Never soft-capped: transformers 5.24's Gemma3ForConditionalGeneration ignores
    # text_config.final_logit_softcapping (only its text-only Gemma3ForCausalLM applies it), and real Gemma-3
    # configs leave it unset.
    applies_final_logit_softcap: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        self.vision_tower: nn.Module | None = None
        self.multi_modal_projector: Gemma3MultiModalProjector | None = None
        if not language_model_only:
            self.vision_tower = build_transformers_tower(self.vision_tower_class, config.hf_config.vision_config)
            self.multi_modal_projector = Gemma3MultiModalProjector(config)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """The names transformers 5 saves (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`),
        its in-memory ones (`model.language_model.*`, `model.vision_tower.*`, ...) and the original Gemma-3
        checkpoints' (`vision_tower.vision_model.*`). More specific prefixes come first."""
        vision = None if language_model_only else "vision_tower."
        projector = None if language_model_only else "multi_modal_projector."
        lm_head = None if config.tie_word_embeddings else "lm_head."
        return WeightMapping(
            prefix_rules=(
                ("model.language_model.", "model."),
                ("language_model.model.", "model."),
                ("language_model.lm_head.", lm_head),
                ("model.vision_tower.vision_model.", vision),
                ("model.vision_tower.", vision),
                ("vision_tower.vision_model.", vision),
                ("vision_tower.", vision),
                ("model.multi_modal_projector.", projector),
                ("multi_modal_projector.", projector),
                ("lm_head.", lm_head),
            ),
            stacked=STACKED_PARAMS,
            stacked_prefix="model.",  # the vision tower keeps transformers' own module layout
        )

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_tower is None else {Modality.IMAGE: self.get_image_feature}

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """As CausalLM.embed; an image token id past the vocabulary (possible in Gemma-3 configs) embeds row 0
        before its row is replaced, as in transformers."""
        ids = fb.input_ids
        image_id = self.config.image_token_id
        if image_id is not None and image_id >= self.config.vocab_size:
            ids = ids.masked_fill(ids == image_id, 0)
        return merge_mm_embeddings(self.model.embed_tokens(ids), fb.mm_embed_rows, fb.mm_embeds)

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [(1 + num_crops) * mm_tokens_per_image, hidden] per item, in order; all images and
        crops of the call in one tower call. An item's `feature` is its pixel values [1 + num_crops, 3, S, S]
        (the original image first, then its crops), or it carries a `precomputed_embedding`."""
        weight = self.model.embed_tokens.like
        pixels: list[torch.Tensor] = []
        for i, item in enumerate(items):
            if item.precomputed_embedding is not None:
                continue
            if item.feature is None:
                raise ValueError(f"item {i}: neither feature nor precomputed_embedding is set")
            if item.feature.ndim != 4:
                raise ValueError(f"item {i}: feature must be pixel values [images, channels, height, width], "
                                 f"got shape {tuple(item.feature.shape)}")
            pixels.append(item.feature)

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.vision_tower is None or self.multi_modal_projector is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
            tower_dtype = next(self.vision_tower.parameters()).dtype
            batch = torch.cat(pixels).to(device=weight.device, dtype=tower_dtype)
            patches = self.vision_tower(pixel_values=batch, return_dict=True).last_hidden_state
            embeds = self.multi_modal_projector(patches).to(weight.dtype)  # [N, tokens, H]
            return [e.reshape(-1, e.shape[-1]) for e in embeds.split([p.shape[0] for p in pixels])]

        return self.encode_items(items, encode)
