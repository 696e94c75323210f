"""CLIP and SigLIP through tessera.Engine: Engine.encode of texts gives get_text_features, of images (three formats) the
image tower's get_image_features, normalised or not, batched and alone, texts and images in one batch; a
generation request, a text with an image, and a pooling other than the model's own are refused or ignored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tessera import Engine
from tests.models.clip_testing import make_tiny_clip

TEXTS = ["the red circle", "a dog", "two green squares, far apart!"]


# SigLIP's Engine path is CLIP's (its model-level parity is in tests/models/test_clip.py): slow, to keep `make test` short.
@pytest.fixture(scope="module", params=["clip", pytest.param("siglip", marks=pytest.mark.slow)])
def clip(request, tmp_path_factory):
    from transformers import AutoProcessor

    path = tmp_path_factory.mktemp(f"tiny-{request.param}-engine")
    return path, make_tiny_clip(path, seed=1, kind=request.param), AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (50, 30))]


def same(out: dict, ref: torch.Tensor, normalize: bool = True) -> None:
    ref = torch.nn.functional.normalize(ref, dim=-1) if normalize else ref
    ours = torch.tensor(out["embedding"])
    assert ours.shape == ref.shape
    assert float(torch.nn.functional.cosine_similarity(ours, ref, dim=0)) >= 0.99999
    assert float((ours - ref).abs().max()) <= 1e-4


def test_engine_encode_matches_clip_features(clip, images):
    path, hf, processor = clip
    with torch.no_grad():
        text_refs = [hf.get_text_features(**processor.tokenizer([t], return_tensors="pt")).pooler_output[0]
                     for t in TEXTS]
        enc = processor.image_processor(images=images, return_tensors="pt")
        image_refs = hf.get_image_features(pixel_values=enc["pixel_values"]).pooler_output
    assert float(torch.nn.functional.cosine_similarity(text_refs[0], text_refs[1], dim=0)) < 0.999
    with Engine(str(path), max_total_tokens=1024, show_progress=False) as engine:
        for out, ref in zip(engine.encode(TEXTS), text_refs):
            same(out, ref)
        same(engine.encode(TEXTS[2], normalize=False), text_refs[2], normalize=False)
        same(engine.encode(TEXTS[0], pooling="mean"), text_refs[0])  # CLIP pools by its own rule
        for out, ref in zip(engine.encode(image_data=images), image_refs):  # raw images, one embedding each
            same(out, ref)
            assert out["meta_info"]["prompt_tokens"] == 1
        mixed = engine.encode([TEXTS[1], ""], image_data=[None, images[1]])  # a text and an image in one batch
        same(mixed[0], text_refs[1])
        same(mixed[1], image_refs[1])
        processed = engine.encode(image_data=dict(pixel_values=enc["pixel_values"][1], format="processor_output"))
        same(processed, image_refs[1])
        pre = engine.encode(image_data=dict(feature=image_refs[0], format="precomputed_embedding"), normalize=False)
        same(pre, image_refs[0], normalize=False)
        same(engine.encode(image_data=images[0], dimensions=8), image_refs[0][:8])
        with pytest.raises(ValueError, match="^prompt: CLIP embeds a text or an image"):
            engine.encode("the cat", image_data=images[0])
        with pytest.raises(ValueError, match="^prompt: (CLIPModel|SiglipModel) is an embedding model"):
            engine.generate("the cat", {"max_new_tokens": 2})
        with pytest.raises(ValueError, match="^dimensions:"):
            engine.encode("the cat", dimensions=10_000)
