"""What the M-RoPE vision-language families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) share in the tests: a prompt of
text tokens and media items, HF's rope index, and the parity suite's case whose extend steps take our [3, n]
positions (checked against HF's once per prompt) and whose decode steps continue them by the prompt's delta;
then a complete checkpoint's real processor against HF's.

A family's testing module supplies how a prompt is laid out (`build_prompt`), its own positions
(`our_positions`) and, where HF takes more than the grids, `MRopePrompt.hf_extra`.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tests.models.family_parity import (
    FamilyCase,
    Seeded,
    check_processed_prompt_matches_hf,
    media_embeds,
    media_parts,
    prompt_key,
)
from tests.models.mrope_reference import decode_mrope_positions
from tests.models.paged_driver import PagedKV, Step


@dataclass
class MRopePrompt:
    input_ids: torch.Tensor  # [L]
    mm_token_type_ids: torch.Tensor  # [L] 0 text, 1 image, 2 video
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def _of(self, modality: Modality) -> list[MultimodalDataItem]:
        return [it for it in self.items if it.modality == modality]

    def grids(self, modality: Modality) -> torch.Tensor | None:
        key = "image_grid_thw" if modality == Modality.IMAGE else "video_grid_thw"
        g = [it.model_specific_data[key] for it in self._of(modality)]
        return torch.cat(g) if g else None

    def pixels(self, modality: Modality) -> torch.Tensor | None:
        p = [it.feature for it in self._of(modality)]
        return torch.cat(p) if p else None

    def hf_extra(self) -> dict[str, Any]:
        """What HF's forward and get_rope_index take besides the ids, types and grids (none here)."""
        return {}

    def hf_inputs(self) -> dict:
        """HF forward/generate kwargs. Absent media are left out rather than passed as None: transformers
        5.24's generate runs every modality's get_*_features whose pixel key is present, even when None."""
        inputs = dict(
            input_ids=self.input_ids[None], mm_token_type_ids=self.mm_token_type_ids[None],
            pixel_values=self.pixels(Modality.IMAGE), image_grid_thw=self.grids(Modality.IMAGE),
            pixel_values_videos=self.pixels(Modality.VIDEO), video_grid_thw=self.grids(Modality.VIDEO),
            **self.hf_extra(),
        )
        return {k: v for k, v in inputs.items() if v is not None}

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ProcessedPrompt:
    """Our processor's output as a prompt: its ids, items and the positions it computed."""

    input_ids: torch.Tensor
    items: list[MultimodalDataItem]
    mrope_positions: torch.Tensor
    delta: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def mm_types(ids: list[int], image_id: int, video_id: int) -> torch.Tensor:
    """mm_token_type_ids of `ids`: 1 on image pads, 2 on video pads, 0 elsewhere."""
    return torch.tensor([1 if i == image_id else 2 if i == video_id else 0 for i in ids])


def build_span_prompt(parts: list, seed: int, prompt_cls: type, patch_dim: int, ids_of: tuple[int, int, int, int],
                      merge: int = 2) -> Any:
    """Qwen2-VL's and Qwen2.5-VL's layout. parts: int n = n random text tokens (ids < 100); ("image", (t, h, w))
    or ("video", (t, h, w)[, seconds per temporal grid step]) = <vision_start>, t*h*w/merge^2 pads,
    <vision_end>, with random pixel rows. `ids_of`: the image, video, start and end token ids. Same parts and
    seed -> same prompt."""
    image_id, video_id, start_id, end_id = ids_of
    ids: list[int] = []
    items = []
    for part, g in media_parts(parts, seed, ids):
        kind, (t, h, w) = part[0], part[1]
        num = t * h * w // merge**2
        is_image = kind == "image"
        ids.append(start_id)
        start = len(ids)
        ids += [image_id if is_image else video_id] * num + [end_id]
        msd = {("image_grid_thw" if is_image else "video_grid_thw"): torch.tensor([[t, h, w]])}
        if len(part) > 2:
            msd["second_per_grid_ts"] = torch.tensor([float(part[2])])
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE if is_image else Modality.VIDEO, hash=len(items), offsets=[(start, start + num)],
            feature=torch.randn(t * h * w, patch_dim, generator=g), model_specific_data=msd,
        ))
    return prompt_cls(torch.tensor(ids), mm_types(ids, image_id, video_id), items)


def hf_positions(hf, prompt: MRopePrompt) -> tuple[torch.Tensor, int]:
    """HF's rope index for one prompt ([3, L], delta)."""
    if not prompt.items:
        return torch.arange(len(prompt)).expand(3, -1).clone(), 0
    pos, delta = hf.model.get_rope_index(
        prompt.input_ids[None], prompt.mm_token_type_ids[None], image_grid_thw=prompt.grids(Modality.IMAGE),
        video_grid_thw=prompt.grids(Modality.VIDEO), **prompt.hf_extra(),
    )
    return pos[:, 0], int(delta.reshape(-1)[0])


def prompt_mm_embeds(model, prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embedding rows [n, width]) for the whole prompt, in row order; images in one
    encoder call, videos in one."""
    if not prompt.items:
        return None, None
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat(media_embeds(model, prompt.items))


@dataclass
class MRopeCase(FamilyCase):
    """HF derives positions from the grids itself; we feed ours, which must equal its rope index."""

    mrope: dict = field(default_factory=dict, repr=False)  # prompt key -> (positions [3, L], delta)

    tower_attr = "visual"

    @abstractmethod
    def our_positions(self, prompt: MRopePrompt) -> tuple[torch.Tensor, int]:
        """Our M-RoPE positions ([3, L], delta) from the family's processor code."""

    def hf_inputs(self, prompt: MRopePrompt) -> dict:
        return prompt.hf_inputs()

    def hf_greedy_of(self, inputs: dict, prompt: Any, num_new: int) -> tuple[list[int], float]:
        """The decode positions are the model's: prompt length + i + rope_deltas, with rope_deltas = max prompt
        position + 1 - prompt length (Qwen's convention, HF's cached forward, vLLM, SGLang and ours); the deltas
        a previous call left on the model are cleared first. transformers 5.24's generate() differs: it
        continues each M-RoPE row from the LAST prompt position + 1 (GenerationMixin.
        _update_model_kwargs_for_generation), which is not max + 1 when a video's time-scaled temporal
        positions reach past the text after it; for the decode prompts, whose last position is the max, the
        fixtures check the two agree."""
        self.hf.model.rope_deltas = None
        return super().hf_greedy_of(inputs, prompt, num_new)

    def positions_of(self, prompt: Any) -> tuple[torch.Tensor, int]:
        if hasattr(prompt, "mrope_positions"):  # a ProcessedPrompt (its module may be imported under two names)
            return prompt.mrope_positions, prompt.delta
        key = prompt_key(prompt)
        if key not in self.mrope:
            positions, delta = self.our_positions(prompt)
            ref_positions, ref_delta = hf_positions(self.hf, prompt)
            assert torch.equal(positions, ref_positions) and delta == ref_delta
            self.mrope[key] = positions, delta
        return self.mrope[key]

    def positions(self, prompt: Any, lo: int, hi: int) -> torch.Tensor:
        return self.positions_of(prompt)[0][:, lo:hi]

    def decode_step(self, kv: PagedKV, row: int, logits: torch.Tensor, prompt: Any) -> Step:
        return Step(row, logits.argmax().reshape(1), decode_mrope_positions(kv.lens[row], self.positions_of(prompt)[1]))

    def hf_item_features(self, output: Any) -> list[torch.Tensor]:
        """Per-item embedding rows from HF's get_*_features output."""
        return list(output.pooler_output)

    def hf_media_features(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        prompt = MRopePrompt(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), items)
        by_item: dict[int, torch.Tensor] = {}
        for modality, fn in ((Modality.IMAGE, "get_image_features"), (Modality.VIDEO, "get_video_features")):
            idx = [i for i, it in enumerate(items) if it.modality == modality]
            if idx:
                out = getattr(self.hf.model, fn)(prompt.pixels(modality), prompt.grids(modality))
                by_item.update(zip(idx, self.hf_item_features(out)))
        return [by_item[i] for i in range(len(items))]


# B shares A's prompt up to its text suffix (image rows 5..20, <vision_end> at 21, in both Qwen2.5-VL's and
# Qwen3-VL's layouts): all of the image and <vision_end> with page size 1, a page-aligned cut inside the image
# with page size 4.
PREFIX = Seeded([4, ("image", (1, 8, 8)), 6], 7)
PREFIX_CUTS = {"page1": (1, lambda case, a: 22), "page4": (4, lambda case, a: 12)}


def check_real_processor_matches_hf(case: MRopeCase, processor, hf_processor, image_hw: tuple[int, int],
                                    frame_hw: tuple[int, int], ref_keys: tuple[str, ...]) -> tuple[Any, dict]:
    """One image and a clip of 4 frames sampled at 1.5 fps from 8 at 3 fps through our processor and HF's: the
    same ids, pixels and positions, and our model on ours gives HF's logits and greedy tokens on HF's (`ref_keys`:
    what HF's model takes of its processor's output). Returns (our output, HF's)."""
    import numpy as np
    from PIL import Image

    from tessera.multimodal.media import VideoClip

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (*image_hw, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 256, (*frame_hw, 3), dtype=np.uint8)) for _ in range(4)]
    clip = VideoClip(frames, fps=3.0, total_num_frames=8, sampled_indices=[0, 2, 4, 6])
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is shown here?"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=[image], video_data=[clip])
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=[image], videos=[frames], return_tensors="pt", videos_kwargs={
        "do_sample_frames": False,
        "video_metadata": [{"fps": 3.0, "total_num_frames": 8, "frames_indices": [0, 2, 4, 6]}]})
    assert out.input_ids == ref["input_ids"][0].tolist()
    image_item, video_item = out.mm_inputs.items
    torch.testing.assert_close(image_item.feature, ref["pixel_values"], atol=0, rtol=0)
    torch.testing.assert_close(video_item.feature, ref["pixel_values_videos"], atol=0, rtol=0)
    ref_inputs = {k: ref[k] for k in ref_keys}
    extra = {k: ref[k] for k in ref_keys if k == "second_per_grid_ts"}
    ref_pos, ref_delta = case.hf.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"], **extra)
    mm = out.mm_inputs
    assert torch.equal(mm.mrope_positions, ref_pos[:, 0]) and mm.mrope_position_delta == int(ref_delta.reshape(-1)[0])
    prompt = ProcessedPrompt(torch.tensor(out.input_ids), mm.items, mm.mrope_positions, mm.mrope_position_delta)
    check_processed_prompt_matches_hf(case, prompt, ref_inputs)
    return out, ref
