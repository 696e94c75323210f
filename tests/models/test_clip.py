"""CLIP and SigLIP as Tessera models: our CLIPModel / SiglipModel (transformers' towers under our loader and step)
give transformers' get_text_features / get_image_features, texts of different lengths batched in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tessera.layers.forward_batch import ForwardBatch
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.clip import CLIPModel
from tessera.models.siglip import SiglipModel
from tessera.models.registry import load_model
from tests.models.clip_testing import make_tiny_clip

TEXTS = ["the red circle", "a dog", "two green squares, far apart!"]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def clip(request, tmp_path_factory):
    from transformers import AutoProcessor

    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = make_tiny_clip(path, kind=request.param)
    ours, config = load_model(path, torch.float32)
    want = (SiglipModel, 32) if request.param == "siglip" else (CLIPModel, 24)
    assert type(ours) is want[0] and config.family.embedding_only and config.embedding_size == want[1]
    return hf, ours, AutoProcessor.from_pretrained(path)


def test_texts_batched_in_one_step_match_get_text_features(clip):
    hf, ours, processor = clip
    ids = [processor.tokenizer(t)["input_ids"] for t in TEXTS]
    with torch.no_grad():
        refs = [hf.get_text_features(input_ids=torch.tensor([i])).pooler_output[0] for i in ids]
    assert float(torch.nn.functional.cosine_similarity(refs[0], refs[1], dim=0)) < 0.999
    flat = torch.tensor([t for i in ids for t in i])
    lens = torch.tensor([len(i) for i in ids])
    rows = torch.cumsum(lens, 0) - 1
    fb = ForwardBatch(input_ids=flat, positions=torch.arange(len(flat)), out_cache_loc=torch.arange(len(flat)),
                      req_pool_indices=torch.arange(3), seq_lens=lens, extend_lens=lens,
                      req_to_token=torch.zeros(4, 64, dtype=torch.int64), logits_indices=torch.tensor([]),
                      hidden_indices=rows)
    with torch.no_grad():
        ours(fb, None)
    for got, ref in zip(fb.hidden_states, refs):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_images_match_get_image_features(clip):
    hf, ours, processor = clip
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (32, 32))]
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        refs = hf.get_image_features(pixel_values=pixels).pooler_output
        items = [MultimodalDataItem(Modality.IMAGE, i, [(0, 1)], feature=p[None]) for i, p in enumerate(pixels)]
        got = ours.get_image_feature(items)
    assert float(torch.nn.functional.cosine_similarity(refs[0], refs[1], dim=0)) < 0.999
    for g, r in zip(got, refs):
        assert g.shape == (1, ours.projection_dim)
        torch.testing.assert_close(g[0], r, atol=1e-5, rtol=0)
