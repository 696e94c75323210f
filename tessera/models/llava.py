"""LLaVA-1.5 (`LlavaForConditionalGeneration` with a CLIP or SigLIP tower): our decoder over the paged KV cache, the
language model its `text_config` names (Llama, Mistral, Qwen2: models/text_backbones.py), + transformers'
vision tower + the projector.

An image is one `image_size` x `image_size` crop. The tower's hidden states at `vision_feature_layer` (an index
into [embeddings, layer 1, ..., layer N], or a list of them concatenated along the features) become the image's
tokens; with `vision_feature_select_strategy="default"` the CLS token is dropped, with "full" it is kept. The
projector (`multi_modal_projector`: linear_1, act, linear_2) maps them to the language model's width. All images
of a step go through the tower in one call. `LlavaImageGeometry` holds the token arithmetic the processor and
the model share (LLaVA-NeXT extends it with tiles, tessera.models.llava_next).
"""

from __future__ import annotations


import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.linear import Linear
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.text_backbones import WrappedTextModel
from tessera.messages.items import MultimodalDataItem
from tessera.multimodal.geometry import VISION_TOWERS, LlavaImageGeometry

class LlavaMultiModalProjector(nn.Module):
    """Tower features (vision width x number of feature layers) -> language-model width, as transformers'
    `multi_modal_projector` (linear_1, act, linear_2)."""

    def __init__(self, in_features: int, text_hidden: int, act: str, bias: bool):
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_1 = Linear(in_features, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(WrappedTextModel, CausalLM):
    """Items carry `feature` (pixels [C, image_size, image_size]) or a `precomputed_embedding`."""

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        hf_config = config.hf_config
        self.geometry = LlavaImageGeometry.from_config(hf_config)
        layer = hf_config.vision_feature_layer
        self.vision_feature_layer: int | list[int] = int(layer) if isinstance(layer, int) else [int(x) for x in layer]
        num_layers = 1 if isinstance(self.vision_feature_layer, int) else len(self.vision_feature_layer)
        vision = hf_config.vision_config
        self.vision_tower: nn.Module | None = None
        self.multi_modal_projector: LlavaMultiModalProjector | None = None
        if not language_model_only:
            self.vision_tower = build_transformers_tower(VISION_TOWERS[vision.model_type][0], vision)
            self.multi_modal_projector = LlavaMultiModalProjector(
                int(vision.hidden_size) * num_layers, config.hidden_size, str(hf_config.projector_hidden_act),
                bool(getattr(hf_config, "multimodal_projector_bias", True)))

    # ---- image encoding ---------------------------------------------------------------------------------

    def tile_features(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles [n, C, S, S] -> projected features [n, tokens_per_tile, hidden] (HF's get_image_features
        before any anyres packing)."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
        layer = self.vision_feature_layer
        # Every layer's hidden states, then the selected ones (transformers >= 5.23 can keep only the selected
        # layers when given their indices, older 5.x return None for them).
        hidden = self.vision_tower(tiles, output_hidden_states=True, return_dict=True).hidden_states
        selected = [hidden[layer]] if isinstance(layer, int) else [hidden[i] for i in layer]
        if self.geometry.select_strategy == "default":
            selected = [h[:, 1:] for h in selected]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def item_tiles(self, i: int, item: MultimodalDataItem) -> torch.Tensor:
        """The tiles [n, C, S, S] of item i (checked); LLaVA-1.5: its one crop."""
        g = self.geometry
        expected = (g.num_channels, g.image_size, g.image_size)
        if item.feature is None or tuple(item.feature.shape) != expected:
            shape = None if item.feature is None else tuple(item.feature.shape)
            raise ValueError(f"image item {i}: pixel feature has shape {shape}, the vision tower takes {expected}")
        return item.feature[None]

    def pack_item(self, item: MultimodalDataItem, features: torch.Tensor) -> torch.Tensor:
        """An item's tile features [n, tokens_per_tile, hidden] -> its embedding [num_tokens, hidden]."""
        return features[0]

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tokens, hidden] per image item, in order; every tile of every pixel item in one
        tower call. Precomputed embeddings are returned as they are (cast to the model's dtype/device)."""
        weight = self.model.embed_tokens.like
        tiles = {i: self.item_tiles(i, item) for i, item in enumerate(items) if item.precomputed_embedding is None}

        def encode(todo: list[int]) -> list[torch.Tensor]:
            batch = torch.cat([tiles[i] for i in todo]).to(device=weight.device, dtype=weight.dtype)
            features = self.tile_features(batch).split([tiles[i].shape[0] for i in todo])
            return [self.pack_item(items[i], f) for i, f in zip(todo, features)]

        return self.encode_items(items, encode)
