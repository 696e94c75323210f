"""Gemma 4 (`Gemma4ForConditionalGeneration`, and text-only `Gemma4ForCausalLM`): our Gemma 4 decoder over the
paged KV cache (layers/gemma4_decoder.py) + transformers' Gemma4VisionModel + our multimodal embedder.

Images and video frames keep their aspect ratio: the processor resizes each to at most max_soft_tokens x k^2
patches (k = pooling_kernel_size) and hands over the patches as rows [patches, 3 * p * p] with their (x, y)
positions. An item's `feature` is those rows (an image: [patches, 3p^2]; a video: [frames, patches, 3p^2]),
model_specific_data["position_ids"] their positions ([patches, 2] / [frames, patches, 2]). The tower pools
each k x k block into one soft token, so an image has patches / k^2 tokens, a video that many per frame. The
embedder RMS-normalises the tower output (no scale) and projects it to the text width.

Media spans attend bidirectionally in sliding layers during prefill when the text config's
use_bidirectional_attention is "vision" (the family row keeps spans whole in prefill chunks; the decoder
leaves full layers causal).

Audio, where the checkpoint has an audio tower (E2B / E4B): transformers' Gemma4AudioModel (a conformer over the
feature extractor's log-mel frames, subsampled 4x) and our embedder. An audio item's `feature` is its valid mel
frames [frames, bins]; the audios of a call are padded to the longest with masked frames (the tower zeroes masked
frames before each subsampling conv, its convolutions look left only and its attention masks them, so the valid
tokens do not depend on the padding). Audio spans are causal, as in transformers (only image and video tokens
form bidirectional blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.gemma4_decoder import Gemma4TextModel
from tessera.layers.gemma_decoder import rms_normalize
from tessera.layers.linear import Linear
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder, StepLayout, StepSegment
from tessera.models.causal_lm import CausalLM
from tessera.models.config import KVLayout, ModelConfig
from tessera.models.hf_towers import build_transformers_tower, buffers_as_parameters
from tessera.models.mm_embed import merge_mm_embeddings
from tessera.models.weights import WeightMapping

POSITION_IDS = "position_ids"  # model_specific_data key: each patch's (x, y)


class Gemma4MultimodalEmbedder(nn.Module):
    """Tower output [N, Dv] -> [N, D]: RMS-normalised without a scale, then projected."""

    def __init__(self, width: int, hidden_size: int, eps: float):
        super().__init__()
        self.embedding_projection = Linear(width, hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_normalize(x, self.eps).to(x.dtype))


class Gemma4ForCausalLM(CausalLM):
    """Text-only Gemma 4 (`Gemma4ForCausalLM`, model_type gemma4_text); checkpoint names `model.*`, `lm_head.*`.
    Soft-caps the final logits where the config says so, as transformers does."""

    decoder_model_class = Gemma4TextModel
    # MoE layers read each step's routing back on the host (the expert loop); dense configs are not captured yet
    # either (one flag per class).
    cuda_graph_decode = False

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout  # every layer in the widest layer's shape (layers/gemma4_decoder.py)


def check_config(hf_config: Any) -> None:
    """One clear error for a Gemma 4 config without what the multimodal model needs (before weights load)."""
    if getattr(hf_config, "vision_config", None) is None:
        raise ValueError("vision_config: a Gemma4ForConditionalGeneration config needs a vision_config "
                         "(serve a text-only checkpoint as Gemma4ForCausalLM, or pass --language-model-only)")


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The worker encodes images and video frames with get_image_feature / get_video_feature (or takes them from
    its encoder cache) and puts the embedding rows of this step's media tokens into fb.mm_embed_rows/mm_embeds."""

    vision_tower_class: ClassVar[str] = "transformers.models.gemma4.modeling_gemma4:Gemma4VisionModel"
    audio_tower_class: ClassVar[str] = "transformers.models.gemma4.modeling_gemma4:Gemma4AudioModel"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        hf = config.hf_config
        if not language_model_only:
            check_config(hf)
        super().__init__(config, attn_backend, language_model_only)
        media = [getattr(hf, name, None) for name in ("image_token_id", "video_token_id", "audio_token_id")]
        self.model.media_token_ids = torch.tensor([int(t) for t in media if t is not None], dtype=torch.long)
        self.vision_tower: nn.Module | None = None
        self.embed_vision: Gemma4MultimodalEmbedder | None = None
        if not language_model_only:
            vision = hf.vision_config
            self.vision_tower = build_transformers_tower(self.vision_tower_class, vision)
            buffers_as_parameters(self.vision_tower)  # standardize / clipped-linear buffers are checkpoint tensors
            self.embed_vision = Gemma4MultimodalEmbedder(int(vision.hidden_size), config.hidden_size,
                                                         float(vision.rms_norm_eps))
            self.pooling = int(vision.pooling_kernel_size)
        self.audio_tower: nn.Module | None = None
        self.embed_audio: Gemma4MultimodalEmbedder | None = None
        if not language_model_only and getattr(hf, "audio_config", None) is not None:
            audio = hf.audio_config
            # transformers implements its chunked local attention in eager only
            self.audio_tower = build_transformers_tower(self.audio_tower_class, audio, attn_implementation="eager")
            buffers_as_parameters(self.audio_tower)  # clipped linears' bounds are checkpoint tensors
            self.embed_audio = Gemma4MultimodalEmbedder(int(audio.output_proj_dims), config.hidden_size,
                                                        float(audio.rms_norm_eps))

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """transformers' names (`model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`,
        `model.audio_tower.*`, `model.embed_audio.*`)."""
        vision = None if language_model_only else "vision_tower."
        embed = None if language_model_only else "embed_vision."
        audio = None if language_model_only else "audio_tower."
        embed_audio = None if language_model_only else "embed_audio."
        lm_head = None if config.tie_word_embeddings else "lm_head."
        return WeightMapping(
            prefix_rules=(
                ("model.language_model.", "model."),
                ("model.vision_tower.", vision),
                ("model.embed_vision.", embed),
                ("model.audio_tower.", audio),
                ("model.embed_audio.", embed_audio),
                ("lm_head.", lm_head),
            ),
            stacked=STACKED_PARAMS,
            stacked_prefix="model.",  # the vision tower keeps transformers' own module layout
        )

    def encoders(self) -> dict[Modality, Encoder]:
        out: dict[Modality, Encoder] = {}
        if self.vision_tower is not None:
            out.update({Modality.IMAGE: self.get_image_feature, Modality.VIDEO: self.get_video_feature})
        if self.audio_tower is not None:
            out[Modality.AUDIO] = self.get_audio_feature
        return out

    @classmethod
    def prepare_step(cls, config: ModelConfig, segments: Sequence[StepSegment]) -> StepLayout:
        """As the base, but only image and video spans are bidirectional (transformers' block ids)."""
        layout = super().prepare_step(config, segments)
        if layout.bidirectional_spans is not None:
            layout.bidirectional_spans = [
                sorted(r for item in s.mm_inputs.items if item.modality is not Modality.AUDIO for r in item.offsets)
                if s.mm_inputs is not None else [] for s in segments]
        return layout

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """As CausalLM.embed, media placeholders looking up the pad token's row (replaced after), as in
        transformers."""
        return merge_mm_embeddings(self.model.embed_tokens(self.model.text_ids(fb.input_ids)), fb.mm_embed_rows,
                                   fb.mm_embeds)

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [patches / k^2, hidden] per image item; all images of the call in one tower call."""
        return self._encode(items, image_ndim=2)

    def get_video_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [frames x patches / k^2, hidden] per video item, frames in order."""
        return self._encode(items, image_ndim=3)

    def _encode(self, items: list[MultimodalDataItem], image_ndim: int) -> list[torch.Tensor]:
        frames: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for i, item in enumerate(items):
            if item.precomputed_embedding is not None:
                frames.append([])
                continue
            pixels, positions = item.feature, item.model_specific_data.get(POSITION_IDS)
            if pixels is None or positions is None:
                raise ValueError(f"item {i}: needs feature (patch rows) and model_specific_data['{POSITION_IDS}'], "
                                 "or a precomputed_embedding")
            if pixels.ndim != image_ndim or positions.shape != (*pixels.shape[:-1], 2):
                raise ValueError(f"item {i}: feature {tuple(pixels.shape)} and {POSITION_IDS} "
                                 f"{tuple(positions.shape)} must be [{'frames, ' if image_ndim == 3 else ''}patches, "
                                 "3 * patch_size ** 2] and [..., patches, 2]")
            frames.append(list(zip(pixels.reshape(-1, *pixels.shape[-2:]),
                                   positions.reshape(-1, *positions.shape[-2:]))))

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.vision_tower is None or self.embed_vision is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
            rows = [f for i in todo for f in frames[i]]
            embeds = self.encode_frames(rows)
            sizes = [sum(int(p.shape[0]) // self.pooling ** 2 for p, _ in frames[i]) for i in todo]
            return list(embeds.split(sizes))

        return self.encode_items(items, encode)

    def encode_frames(self, frames: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """(patch rows, positions) per image or frame -> their soft tokens' embeddings, concatenated in order.
        Frames are padded to the longest with position (-1, -1), the tower's padding (masked in attention and
        pooling), and go through the tower in one call."""
        weight = self.model.embed_tokens.like
        tower_dtype = next(self.vision_tower.parameters()).dtype
        longest = max(int(p.shape[0]) for p, _ in frames)
        width = int(frames[0][0].shape[-1])
        pixels = torch.zeros(len(frames), longest, width, dtype=tower_dtype, device=weight.device)
        positions = torch.full((len(frames), longest, 2), -1, dtype=torch.long, device=weight.device)
        for j, (p, pos) in enumerate(frames):
            pixels[j, : p.shape[0]] = p
            positions[j, : p.shape[0]] = pos
        tokens = self.vision_tower(pixel_values=pixels, pixel_position_ids=positions, return_dict=True)
        return self.embed_vision(tokens.last_hidden_state).to(weight.dtype)

    def get_audio_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [tokens, hidden] per audio item (its valid frames subsampled 4x); all audios of the call
        in one tower call. An item's `feature` is its log-mel frames [frames, bins]."""
        for i, item in enumerate(items):
            if item.precomputed_embedding is None and (item.feature is None or item.feature.ndim != 2):
                raise ValueError(f"audio item {i}: feature must be log-mel frames [frames, bins], got "
                                 f"{None if item.feature is None else tuple(item.feature.shape)}")

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.audio_tower is None or self.embed_audio is None:
                raise RuntimeError("this model has no audio tower (no audio_config, or language_model_only=True)")
            weight = self.model.embed_tokens.like
            mels = [items[i].feature for i in todo]
            longest = max(int(m.shape[0]) for m in mels)
            dtype = next(self.audio_tower.parameters()).dtype
            batch = torch.zeros(len(mels), longest, mels[0].shape[-1], dtype=dtype, device=weight.device)
            mask = torch.zeros(len(mels), longest, dtype=torch.bool, device=weight.device)
            for j, m in enumerate(mels):
                batch[j, : m.shape[0]], mask[j, : m.shape[0]] = m, True
            out = self.audio_tower(batch, mask, return_dict=True)
            embeds = self.embed_audio(out.last_hidden_state).to(weight.dtype)
            return [e[valid] for e, valid in zip(embeds, out.attention_mask)]

        return self.encode_items(items, encode)
