"""Tiny random dual-encoder checkpoints (transformers' CLIPModel, SiglipModel) with a small CLIP tokenizer and the
family's image processor, written offline: what the CLIP and SigLIP tests load with transformers and Tessera."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

CHARS = list(string.ascii_lowercase + string.digits + ".,!?'")


def write_clip_processor(path: Path, image_size: int = 32, kind: str = "clip") -> int:
    """A byte-free CLIP BPE vocabulary (characters, word-final characters, a few merges) and the family's image
    processor of `image_size` (CLIP's resizes and center-crops, SigLIP's resizes); returns the vocabulary size."""
    from transformers import (CLIPImageProcessor, CLIPProcessor, CLIPTokenizer, SiglipImageProcessor,
                              SiglipProcessor)

    vocab = {c: i for i, c in enumerate(CHARS)}
    for c in CHARS:
        vocab[c + "</w>"] = len(vocab)
    for token in ("</w>", "th", "the</w>", "<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    work = path / "_tokenizer_src"
    work.mkdir(parents=True, exist_ok=True)
    (work / "vocab.json").write_text(json.dumps(vocab))
    (work / "merges.txt").write_text("#version: 0.2\nt h\nth e</w>\n")
    tokenizer = CLIPTokenizer(str(work / "vocab.json"), str(work / "merges.txt"))
    if kind == "siglip":
        SiglipProcessor(image_processor=SiglipImageProcessor(size={"height": image_size, "width": image_size}),
                        tokenizer=tokenizer).save_pretrained(path)
        return len(vocab)
    images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    return len(vocab)


def make_tiny_clip(path: Path, seed: int = 0, image_size: int = 32, kind: str = "clip"):
    """The checkpoint at `path` (random weights, scaled up so outputs depend on inputs); returns HF's model."""
    from transformers import CLIPModel, SiglipModel

    vocab_size = write_clip_processor(path, image_size, kind)
    torch.manual_seed(seed)
    if kind == "siglip":
        model = SiglipModel(tiny_siglip_config(vocab_size, image_size))
    else:
        model = CLIPModel(tiny_clip_config(vocab_size, image_size))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model.eval()


def tiny_clip_config(vocab_size: int = 82, image_size: int = 32):
    """Text tower 32 wide (its last two ids BOS and EOS), vision tower 48 wide over 8-pixel patches,
    projections to 24."""
    from transformers import CLIPConfig

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=40, bos_token_id=vocab_size - 2,
                eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    vision = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=8)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=24, architectures=["CLIPModel"])


def tiny_siglip_config(vocab_size: int = 82, image_size: int = 32):
    """Both towers 32 wide (SigLIP's heads keep the width), the vision tower over 8-pixel patches."""
    from transformers import SiglipConfig

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=40, bos_token_id=vocab_size - 2,
                eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=image_size, patch_size=8)
    return SiglipConfig(text_config=text, vision_config=vision, architectures=["SiglipModel"])
