"""CausalLM: a decoder-only language model (shared decoder blocks + LM head) under the model contract.

A text family subclasses it and sets `decoder_options`; a multimodal family adds its encoders and
returns them from `encoders()`; the merge of their embeddings into the token embeddings is shared.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import BaseAttentionBackend, get_attention_backend
from tessera.layers.decoder import STACKED_PARAMS, DecoderModel, DecoderOptions
from tessera.distributed.parallel_state import tp_group
from tessera.layers.linear import ParallelLMHead
from tessera.models.base import TesseraModel
from tessera.models.config import KVLayout, ModelConfig
from tessera.models.mm_embed import item_embeddings, merge_mm_embeddings
from tessera.models.weights import WeightMapping
from tessera.messages.items import MultimodalDataItem
from tessera.layers.forward_batch import ForwardBatch


class CausalLM(TesseraModel):
    """forward(fb, pool) -> logits [num_logits, vocab] for fb.logits_indices."""

    decoder_options: ClassVar[DecoderOptions] = DecoderOptions()
    # The `model.*` stack: (config, options, backend) -> module with embed_tokens and forward(x, positions, fb,
    # pool) -> final hidden states. A family with its own block layout (Gemma-3) names its own.
    decoder_model_class: ClassVar[type[torch.nn.Module]] = DecoderModel
    cuda_graph_decode: ClassVar[bool] = True  # the shared decoder blocks (and Gemma-3's) hold to it
    applies_final_logit_softcap: ClassVar[bool] = True  # config.final_logit_softcap, where the config sets one

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__()
        self.config = config
        self.language_model_only = language_model_only
        backend = attn_backend or get_attention_backend("torch_native")
        self.model = self.decoder_model_class(config, self.decoder_options, backend)
        tp = tp_group()
        self.lm_head: ParallelLMHead | None = None  # a headless base model (embeddings only) has none
        if not config.family.headless:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp.rank, tp.size)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def lm_config(self) -> ModelConfig:
        return self.config

    @property
    def kv_layout(self) -> KVLayout:
        """This rank's K/V: its share of the KV heads under tensor parallelism."""
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        kv_heads = attn.num_kv_heads if attn is not None else self.config.num_kv_heads
        return KVLayout(self.config.num_layers, kv_heads, self.config.head_dim)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """`model.*` and `lm_head.*` as in transformers' *ForCausalLM checkpoints; a headless base model's
        (`Qwen2Model.save_pretrained`) without the `model.` prefix."""
        if config.family.headless:
            return WeightMapping(prefix_rules=(("model.", "model."), ("embed_tokens.", "model.embed_tokens."),
                                               ("layers.", "model.layers."), ("norm.", "model.norm."),
                                               ("lm_head.", None)), stacked=STACKED_PARAMS)
        return WeightMapping(
            prefix_rules=(("model.", "model."), ("lm_head.", None if config.tie_word_embeddings else "lm_head.")),
            stacked=STACKED_PARAMS,
        )

    def encode_items(self, items: list[MultimodalDataItem], encode) -> list[torch.Tensor]:
        """Embeddings of `items` (precomputed ones pass through; `encode(indices)` runs the rest in one call),
        in the language model's dtype and device, row counts checked against the placeholders."""
        return item_embeddings(items, encode, self.model.embed_tokens.like)

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """Token embeddings [T, H] with the step's media embeddings merged at their rows."""
        return merge_mm_embeddings(self.model.embed_tokens(fb.input_ids), fb.mm_embed_rows, fb.mm_embeds)

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits for the rows fb.logits_indices of `hidden`; when it is None, for the last new token of
        each request (extend_start_loc + extend_lens - 1), in request order. The rows fb.hidden_indices of
        `hidden` (the final norm's output) are kept in fb.hidden_states for embedding requests."""
        if fb.hidden_indices is not None:
            fb.hidden_states = hidden[fb.hidden_indices]
        rows = fb.logits_indices
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_lens - 1
        if self.lm_head is None:  # embeddings only: nothing is ever sampled
            return hidden.new_zeros((int(rows.shape[0]), 1))
        logits = self.lm_head(hidden[rows])
        cap = self.config.final_logit_softcap
        if cap and self.applies_final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(fb) if input_embeds is None else input_embeds
        return self.compute_logits(self.model(x, fb.positions, fb, pool), fb)
