"""Tiny random checkpoints and PEFT adapters for the LoRA tests, and HF + PEFT greedy references.

An adapter saved by `get_peft_model(...).save_pretrained` starts with B = 0 (it adds nothing): the helpers
give A and B random values large enough to change greedy tokens, and the tests check that they do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.config import ASSETS_DIR

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_text_checkpoint(path: Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """A tiny random text model (Qwen2, Qwen3, Gemma3 text or Llama-4 text, MoE on its second layer) with demo-vl's
    tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "demo-vl")
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=16, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    elif arch == "llama4":
        cfg = transformers.Llama4TextConfig(**common, intermediate_size_mlp=128, num_local_experts=4,
                                            num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=8,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
        cls = transformers.Llama4ForCausalLM
    else:
        cfg_cls, cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
        cfg = cfg_cls(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() >= 2 else p.uniform_(0.5, 1.5)  # random norms: a dropped one shows
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_adapter(base, path: Path, *, seed: int, r: int = 4, alpha: float = 8, targets=("q_proj", "v_proj"),
                 scale: float = 0.3, **extra) -> Path:
    """A PEFT LoRA adapter over the HF model `base` (left unchanged), saved to `path`, with random A and B."""
    import copy

    from peft import LoraConfig, get_peft_model

    targets = targets if isinstance(targets, str) else list(targets)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                 lora_dropout=0.0, **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(path)
    return path


@torch.no_grad()
def peft_greedy(base_path: Path, model_cls, adapter: Path | None, input_ids: list[int], max_new: int,
                **inputs) -> list[int]:
    """Greedy tokens of HF transformers with `adapter` loaded by PeftModel.from_pretrained (None: the base)."""
    from peft import PeftModel

    model = model_cls.from_pretrained(base_path, attn_implementation="eager").eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([input_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0, **inputs)
    return out[0, len(input_ids):].tolist()
