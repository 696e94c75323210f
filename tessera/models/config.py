"""ModelConfig: the checkpoint's HF config, read and normalised once.

The frontend, the scheduler and the model worker all take their facts about the model from here (the
HF config object is kept as `hf_config` for what only an encoder or a processor needs: vision and audio
sub-configs). Family-specific quirks stay in the family's model file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tessera.layers.decoder import DecoderDims
from tessera.layers.mla import mla_head_dim
from tessera.messages.items import Modality
from tessera.models.families import Family
from tessera.models.quant_config import QuantConfig
from tessera.models.transformers_family import resolve_family


@dataclass(frozen=True)
class KVLayout:
    """What one token's K/V looks like: the KV pool is sized and shaped from this."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return name if name in ("float32", "float16", "bfloat16") else None


def _token_id(cfg: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class ModelConfig(DecoderDims):
    """The language model's sizes (DecoderDims, what the layers read) and the rest of the checkpoint's facts."""

    architecture: str
    model_type: str
    family: Family
    # ---- language model
    final_logit_softcap: float | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str | None  # the checkpoint's dtype ("float32", "bfloat16", "float16"), None when unrecorded
    # ---- media
    image_token_id: int | None
    video_token_id: int | None
    audio_token_id: int | None
    # Encoder-decoder models: K/V entries of a request's cross-attention (its encoder output length); 0 otherwise.
    cross_attention_len: int = 0
    # generation_config.json as a dict ({} when absent): decoding rules some families read (Whisper's).
    generation_config: dict = field(default_factory=dict)
    # A pre-quantized checkpoint's quantization_config (None: float weights); unsupported schemes refused here.
    quant: QuantConfig | None = None
    # (KV heads, head dim) of the widest layer where the text config's per_layer_config gives some layers their
    # own (Gemma 4's full-attention layers); the pool holds every layer's K/V in that shape. None: uniform layers.
    kv_widest: tuple[int, int] | None = None

    @property
    def positions(self) -> str:
        return self.family.positions

    @property
    def kv_layout(self) -> KVLayout:
        heads, dim = self.kv_widest or (self.num_kv_heads, self.head_dim)
        return KVLayout(self.num_layers, heads, dim)

    @property
    def embedding_size(self) -> int:
        """Values in an embedding request's vector: a dual encoder's shared width (CLIP's projection_dim,
        SigLIP's text head's projection_size), else the hidden size."""
        if not self.family.embedding_only:
            return self.hidden_size
        hf = self.hf_config
        return int(hf.projection_dim) if hasattr(hf, "projection_dim") else int(hf.text_config.projection_size)

    @classmethod
    def load(cls, model_path: str | Path, model_impl: str = "auto") -> ModelConfig:
        """The checkpoint's config.json and generation_config.json, each read once: a process loads its
        ModelConfig once and hands it to whatever else needs the checkpoint's settings. `model_impl` (--model-impl)
        picks the family row: native or the Transformers backend (models/transformers_family.py)."""
        from transformers import PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        # AutoConfig.from_pretrained's two steps, so that the file as written is checked too: transformers fills a
        # missing sub-config with its defaults (a 27-layer vision tower the weights then do not match).
        raw, unused = PretrainedConfig.get_config_dict(str(model_path), _from_auto=True, name_or_path=str(model_path))
        hf_config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw, **unused) if "model_type" in raw else None
        if hf_config is None:
            raise ValueError(f"config.json of {model_path} has no model_type")
        config = cls.from_hf(hf_config, model_impl)
        if config.family.modalities & {Modality.IMAGE, Modality.VIDEO} and not raw.get("vision_config"):
            raise ValueError(f"config.json of a {config.family.name} checkpoint lacks vision_config (needed with "
                             "--language-model-only too: the processor reads it)")
        gen = Path(model_path) / "generation_config.json"
        return replace(config, generation_config=json.loads(gen.read_text())) if gen.exists() else config

    @classmethod
    def from_hf(cls, hf_config: Any, model_impl: str = "auto") -> ModelConfig:
        """Reads a transformers config (top-level; text sub-config found with get_text_config).

        Raises UnsupportedArchitectureError for an architecture outside the family table and ValueError
        for an inconsistent config (heads not divisible by KV heads, M-RoPE sections that do not fit).
        """
        family = resolve_family(hf_config, model_impl)
        if family.encoder_decoder:
            return cls._encoder_decoder(hf_config, family)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        num_heads = int(text.num_attention_heads)
        num_kv_heads = int(_global_attr(text, "num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        head_dim = int(_global_attr(text, "head_dim") or text.hidden_size // num_heads)
        if getattr(text, "kv_lora_rank", None):
            # Multi-head latent attention (DeepSeek-V3, Kimi-K2): the pool holds every head's decompressed K and V
            # (layers/mla.py), num_heads of them, each as wide as K's nope + rope dims.
            num_kv_heads, head_dim = num_heads, mla_head_dim(text)
        rope = dict(getattr(text, "rope_parameters", None) or {})
        mrope = None
        if family.positions == "mrope":
            default = _MROPE_SECTION_DEFAULTS.get(str(getattr(hf_config, "model_type", "")), (16, 24, 24))
            mrope = tuple(int(x) for x in rope.get("mrope_section", default))  # HF's default section
        tie = getattr(hf_config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(text, "tie_word_embeddings", False)
        return cls(
            architecture=family.architecture,
            model_type=str(getattr(hf_config, "model_type", "")),
            family=family,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            # An all-MoE text config (Qwen3.5-MoE's) may have no dense width: its MoE blocks read their own.
            intermediate_size=int(_global_attr(text, "intermediate_size") or getattr(text, "moe_intermediate_size", 0)),
            num_layers=int(text.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_act=str(getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            mrope_section=mrope,
            sliding_windows=_sliding_windows(text),
            final_logit_softcap=getattr(text, "final_logit_softcapping", None),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            dtype=_dtype_name(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                              or getattr(text, "dtype", None)),
            image_token_id=_token_id(hf_config, "image_token_id", "image_token_index"),
            video_token_id=_token_id(hf_config, "video_token_id", "video_token_index"),
            audio_token_id=_token_id(hf_config, "audio_token_id", "audio_token_index"),
            hf_config=hf_config,
            quant=QuantConfig.from_hf(hf_config),
            kv_widest=_widest_kv_layer(text, num_kv_heads, head_dim),
        )

    @classmethod
    def _encoder_decoder(cls, hf_config: Any, family: Family) -> ModelConfig:
        """An encoder-decoder config (Whisper's names, shared by BART-style models): the language-model fields
        describe the DECODER (its `num_attention_heads` / `num_hidden_layers` aliases point at the encoder)."""
        heads = int(hf_config.decoder_attention_heads)
        dim = int(hf_config.d_model)
        if dim % heads:
            raise ValueError(f"d_model={dim} is not a multiple of decoder_attention_heads={heads}")
        return cls(
            architecture=family.architecture, model_type=str(hf_config.model_type), family=family,
            vocab_size=int(hf_config.vocab_size), hidden_size=dim, intermediate_size=int(hf_config.decoder_ffn_dim),
            num_layers=int(hf_config.decoder_layers), num_heads=heads, num_kv_heads=heads, head_dim=dim // heads,
            hidden_act=str(getattr(hf_config, "activation_function", "gelu")), rms_norm_eps=0.0,
            rope_type="none", rope_theta=0.0, mrope_section=None, sliding_windows=(None,) * int(hf_config.decoder_layers),
            final_logit_softcap=None, tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            max_position_embeddings=int(hf_config.max_target_positions),
            dtype=_dtype_name(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)),
            image_token_id=None, video_token_id=None, audio_token_id=None, hf_config=hf_config,
            cross_attention_len=int(hf_config.max_source_positions),
        )


def _global_attr(text: Any, name: str) -> Any:
    """A text config's value for all layers that do not override it: a heterogeneous config (per_layer_config)
    refuses plain reads of per-layer attributes, so its stored global is read directly."""
    if getattr(text, "is_heterogeneous", False):
        return vars(text).get(name)
    return getattr(text, name, None)


def _widest_kv_layer(text: Any, num_kv_heads: int, head_dim: int) -> tuple[int, int] | None:
    """(KV heads, head dim) covering every layer of a heterogeneous text config (transformers' per_layer_config
    overrides), None when no layer overrides them."""
    if not getattr(text, "is_heterogeneous", False):
        return None
    layers = [text.per_layer_config[i] for i in range(int(text.num_hidden_layers))]
    heads = [int(getattr(c, "num_key_value_heads", None) or num_kv_heads) for c in layers]
    dims = [int(getattr(c, "head_dim", None) or head_dim) for c in layers]
    if set(heads) == {num_kv_heads} and set(dims) == {head_dim}:
        return None
    return max(heads), max(dims)


# transformers' mrope_section where the config gives none (Qwen2-VL's (16, 24, 24) for the rest).
_MROPE_SECTION_DEFAULTS = {"glm4v": (8, 12, 12), "glm4v_moe": (8, 12, 12)}


def _sliding_windows(text: Any) -> tuple[int | None, ...]:
    """transformers marks sliding layers in `layer_types` ("sliding_attention"); older Qwen2 configs use
    use_sliding_window + max_window_layers (layers from max_window_layers on slide). Mistral slides every
    layer by `sliding_window` when it is set (its modeling file reads nothing else)."""
    num_layers = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "model_type", None) == "mistral":
        return (int(window) if window else None,) * num_layers
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(text, "use_sliding_window", False) and window:
        first = int(getattr(text, "max_window_layers", 0))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def eos_token_ids(config: ModelConfig) -> set[int]:
    """EOS ids from generation_config.json and the text config (either may list several), as ModelConfig.load
    read them: no file is read again."""
    ids: set[int] = set()
    hf_config = config.hf_config
    candidates = [config.generation_config.get("eos_token_id")]
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    candidates.append(getattr(text, "eos_token_id", None))
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, list):
            ids.update(int(x) for x in c)
    return ids
