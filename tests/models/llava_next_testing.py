"""LLaVA-NeXT's row of the family parity suite: images of many aspect ratios (wide, tall, square, extreme,
exactly one tile) pick different grid pinpoints, so their tile grids, unpadding and newline counts differ; each
one's placeholder count is our LlavaImageGeometry.num_image_tokens, which HF's model checks against its own
features in every reference call. Checkpoints, prompts and the case are llava_testing's.
"""

from __future__ import annotations

from tests.models.family_parity import ATOL, Chunked, FamilyFixture, Seeded
from tests.models.llava_testing import SPECS, LlavaCase, build_tiny_llava, load_case, prefix_shared

SIZES = {"wide": (30, 70), "tall": (70, 30), "square": (50, 50), "very_wide": (20, 90), "very_tall": (90, 21),
         "one_tile": (28, 28), "tiny": (3, 5), "sliver": (1, 90)}  # a sliver unpads to 0 or 1 grid rows
PROMPTS = {name: [4, ("image", size), 3] for name, size in SIZES.items()}
PROMPTS["text"] = [12]
TWO_IMAGES = [2, ("image", SIZES["tall"]), 2, ("image", SIZES["very_wide"]), 2]
PROMPTS["two_images"] = TWO_IMAGES
DECODE_PROMPT = [3, ("image", SIZES["wide"]), 5]
TOWER = Seeded([p for size in SIZES.values() for p in (1, ("image", size))], 4)


def check_sizes_give_different_token_counts(case: LlavaCase, monkeypatch) -> None:
    """The tower test's images are not all alike."""
    counts = {it.num_tokens for it in case.build(TOWER).items}
    assert len(counts) >= 4, f"the sizes should give different token counts, got {counts}"


def check_tile_counts_follow_the_config(case: LlavaCase, monkeypatch) -> None:
    from transformers.models.llava_next import modeling_llava_next as hf_next

    from tessera.models.llava import LlavaImageGeometry

    g = LlavaImageGeometry.from_config(case.hf.config)
    assert g.grid_pinpoints == tuple(tuple(p) for p in case.spec.grid_pinpoints)
    for size in SIZES.values():
        assert g.num_tiles(size) == hf_next.image_size_to_num_patches(list(size), case.spec.grid_pinpoints,
                                                                       case.spec.image_size)
    assert g.num_tiles(SIZES["square"]) == 5  # a 2x2 grid + the base tile
    assert case.ours.image_newline is not None and case.ours.image_newline.shape == (case.spec.hidden,)


def check_two_images_over_pages_of_4(case: LlavaCase, monkeypatch) -> None:
    """Prefill of two images of other grids, their rows over interleaved pages of 4 slots."""
    import torch

    from tests.models.family_parity import our_logits

    prompt = case.prompt(TWO_IMAGES, seed=3)
    torch.testing.assert_close(our_logits(case, prompt, page_size=4), case.hf_logits(prompt), atol=ATOL, rtol=0)


FIXTURE = FamilyFixture(
    specs=("next_llama", "next_qwen2"), load_case=lambda name, path: load_case(name, path, DECODE_PROMPT),
    build=lambda path, name: build_tiny_llava(path, SPECS[name]), prompts=PROMPTS, text=Seeded([12], 2),
    decode=Seeded(DECODE_PROMPT, 5), decode_new=8,
    batch=(Seeded([2, ("image", SIZES["square"]), 1, ("image", SIZES["tall"]), 3], 6),
           Seeded([5, ("image", SIZES["one_tile"]), 2], 7)),
    chunked=(Chunked([3, ("image", SIZES["very_tall"]), 2, ("image", SIZES["wide"]), 3], 8, lambda spec: 13, 2),),
    prefix=Seeded([4, ("image", SIZES["wide"]), 6], 9),
    prefix_cuts={f"page{p}": (p, prefix_shared(p)) for p in (1, 4)}, tower=(TOWER,),
    checks={"sizes_give_different_token_counts": check_sizes_give_different_token_counts,
            "tile_counts_follow_the_config": check_tile_counts_follow_the_config,
            "two_images_over_pages_of_4": check_two_images_over_pages_of_4},
)
