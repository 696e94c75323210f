"""`bench-medium`'s GLM-4.1V counterpart: a random-weight Glm4vForConditionalGeneration with GLM-4.1V-9B's layer
shape scaled down to bench-medium's size, for decode and prefill timings beside transformers (`tessera bench
profile --model-path DIR`).

GLM-4.1V-9B's language model: 32 heads of 128 over 4096 with 2 KV heads, RoPE on half of each head with M-RoPE
sections (8, 12, 12), sandwich norms, a fused gate/up MLP. Here: 6 heads of 128 over 768 with 2 KV heads, 12 layers,
the same RoPE (so the same kernels run, at bench-medium's width). The vision tower is small (the profile times the
language model). Config and weights only: no tokenizer (the profile feeds token ids).

`--moe`: GLM-4.5V's instead (Glm4vMoeForConditionalGeneration): the same attention, layer 0 dense, the others 32
routed experts of 384 (top 4, DeepSeek-V3 routing in 4 groups, best 2) plus a shared one.

    python -m tessera.bench.medium_glm4v --out DIR [--moe]    # prints DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEXT_SIZES = dict(vocab_size=32000, hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [8, 12, 12]})
MOE_SIZES = dict(head_dim=128, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                 moe_intermediate_size=384, first_k_dense_replace=1, routed_scaling_factor=2.5)
VISION_SIZES = dict(depth=2, hidden_size=256, intermediate_size=768, num_heads=4, out_hidden_size=768,
                    patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)


def write_medium_glm4v(out: Path, seed: int = 0, moe: bool = False) -> Path:
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    arch = "Glm4vMoeForConditionalGeneration" if moe else "Glm4vForConditionalGeneration"
    config_cls = transformers.Glm4vMoeConfig if moe else transformers.Glm4vConfig
    text = {**TEXT_SIZES, **MOE_SIZES} if moe else TEXT_SIZES
    config = config_cls(text_config=text, vision_config=VISION_SIZES, image_token_id=31990, video_token_id=31991,
                        image_start_token_id=31992, image_end_token_id=31993, video_start_token_id=31994,
                        video_end_token_id=31995, architectures=[arch])
    torch.manual_seed(seed)
    getattr(transformers, arch)._from_config(config).eval().save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="GLM-4.5V's MoE language model instead")
    args = parser.parse_args(argv)
    print(write_medium_glm4v(Path(args.out), args.seed, args.moe))


if __name__ == "__main__":
    main()
