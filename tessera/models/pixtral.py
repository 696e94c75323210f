"""Pixtral (`LlavaForConditionalGeneration` with a Pixtral vision tower): our language model (Mistral or Llama,
or Qwen2/Qwen3 as text_config says) over the paged KV cache + transformers' `PixtralVisionModel`.

Images keep their native resolution (the processor only caps the longest edge and rounds each side up to a
multiple of the patch size), so every image has its own patch grid. The tower embeds each image's patches,
gives them 2-D (row, column) rotary positions, and runs all images of a call as ONE sequence with a
block-diagonal mask (no attention across images): padded pixels [N, C, Hmax, Wmax] plus `image_sizes` are
its input, and each image's patches are cropped out before the transformer. We pad a step's images to a
common size and encode them in that one call. The hidden states of `vision_feature_layer` (or the
concatenation of several layers) go through LLaVA's projector (linear_1, activation, linear_2, biased when
`multimodal_projector_bias`); image i's embedding is its (h / patch) * (w / patch) rows, in row-major order.
The prompt's [IMG_BREAK] / [IMG_END] tokens between the rows are ordinary text tokens.

Checkpoint names: as saved (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`) or transformers 5.x's in-memory names (`model.language_model.*`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.llava import LlavaMultiModalProjector
from tessera.models.text_backbones import WrappedTextModel
from tessera.messages.items import MultimodalDataItem

VISION_TOWER = "transformers.models.pixtral.modeling_pixtral:PixtralVisionModel"


class PixtralLlavaForConditionalGeneration(WrappedTextModel, CausalLM):
    """The worker encodes images with encoders() (or takes them from its encoder cache) and puts the rows of
    this step's [IMG] tokens into fb.mm_embed_rows / fb.mm_embeds."""

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        hf = config.hf_config
        vision = hf.vision_config
        layers = hf.vision_feature_layer
        self.feature_layers: list[int] = [layers] if isinstance(layers, int) else [int(x) for x in layers]
        if hf.vision_feature_select_strategy != "full":
            # "default" drops the first token of the whole packed sequence, as if it were a CLS token; Pixtral
            # has none, and transformers then fails its own placeholder count check.
            raise NotImplementedError(f"vision_feature_select_strategy={hf.vision_feature_select_strategy!r}: "
                                      "a Pixtral tower has no CLS token; only 'full' is supported")
        self.patch_size = int(vision.patch_size)
        self.vision_tower: nn.Module | None = None
        self.multi_modal_projector: LlavaMultiModalProjector | None = None
        if not language_model_only:
            self.vision_tower = build_transformers_tower(VISION_TOWER, vision)
            self.multi_modal_projector = LlavaMultiModalProjector(
                int(vision.hidden_size) * len(self.feature_layers), config.hidden_size,
                str(hf.projector_hidden_act), bool(getattr(hf, "multimodal_projector_bias", True)))

    # ---- image encoding ---------------------------------------------------------------------------------

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [(h / patch) * (w / patch), hidden] per image item, in order; all pixel items in one
        tower call. Each item carries `feature` (its pixels [C, h, w], h and w multiples of the patch size) or a
        `precomputed_embedding` (returned as is, cast to the model's dtype/device)."""
        weight = self.model.embed_tokens.like
        p = self.patch_size
        for i, item in enumerate(items):
            if item.precomputed_embedding is not None:
                continue
            f = item.feature
            if f is None or f.ndim != 3 or f.shape[1] % p or f.shape[2] % p or not f.shape[1] or not f.shape[2]:
                shape = None if f is None else tuple(f.shape)
                raise ValueError(f"image item {i}: feature must be pixels [C, h, w] with h and w positive "
                                 f"multiples of the patch size {p}, got {shape}")

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.vision_tower is None or self.multi_modal_projector is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
            images = [items[i].feature for i in todo]
            sizes = [(int(im.shape[1]), int(im.shape[2])) for im in images]  # type: ignore[union-attr]
            height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
            batch = weight.new_zeros(len(images), images[0].shape[0], height, width)  # type: ignore[union-attr]
            for b, (im, (h, w)) in enumerate(zip(images, sizes)):
                batch[b, :, :h, :w] = im.to(device=weight.device, dtype=weight.dtype)  # type: ignore[union-attr]
            out = self.vision_tower(batch, image_sizes=torch.tensor(sizes), output_hidden_states=True)
            hidden = torch.cat([out.hidden_states[layer] for layer in self.feature_layers], dim=-1)[0]
            embeds = self.multi_modal_projector(hidden)
            return list(embeds.split([(h // p) * (w // p) for h, w in sizes]))

        return self.encode_items(items, encode)
