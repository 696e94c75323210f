"""`bench-medium`'s GLM-4.1V counterpart: a random-weight Glm4vForConditionalGeneration with GLM-4.1V-9B's layer
shape scaled down to bench-medium's size, for decode and prefill timings beside transformers (`tessera bench
profile --model-path DIR`).

GLM-4.1V-9B's language model: 32 heads of 128 over 4096 with 2 KV heads, RoPE on half of each head with M-RoPE
sections (8, 12, 12), sandwich norms, a fused gate/up MLP. Here: 6 heads of 128 over 768 with 2 KV heads, 12 layers,
the same RoPE (so the same kernels run, at bench-medium's width). The vision tower is small (the profile times the
language model). Config and weights only: no tokenizer (the profile feeds token ids).

    python -m tessera.bench.medium_glm4v --out DIR    # prints DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEXT_SIZES = dict(vocab_size=32000, hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [8, 12, 12]})
VISION_SIZES = dict(depth=2, hidden_size=256, intermediate_size=768, num_heads=4, out_hidden_size=768,
                    patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)


def write_medium_glm4v(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    config = Glm4vConfig(text_config=TEXT_SIZES, vision_config=VISION_SIZES, image_token_id=31990,
                         video_token_id=31991, image_start_token_id=31992, image_end_token_id=31993,
                         video_start_token_id=31994, video_end_token_id=31995,
                         architectures=["Glm4vForConditionalGeneration"])
    torch.manual_seed(seed)
    Glm4vForConditionalGeneration._from_config(config).eval().save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_medium_glm4v(Path(args.out), args.seed))


if __name__ == "__main__":
    main()
