"""Test helpers for Qwen2-VL parity: a tiny random config, prompt construction, HF positions, our embeddings.

(A uniquely named module rather than conftest.py, so `import` never picks up another directory's conftest.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.multimodal.items import Modality, MultimodalDataItem

VOCAB, IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 128, 120, 121, 122, 123
MERGE, PATCH_DIM = 2, 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch


def tiny_vl_config(num_kv_heads: int = 2, tie: bool = False):
    from transformers import Qwen2VLConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, rms_norm_eps=1e-6, max_position_embeddings=512,
        # A wider init than HF's 0.02 keeps top logits apart, so greedy decode is not decided by float noise.
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},  # head_dim 16
    )
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3, initializer_range=0.1)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                         vision_start_token_id=VSTART_ID, vision_end_token_id=VEND_ID, tie_word_embeddings=tie)


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [L]
    mm_token_type_ids: torch.Tensor  # [L] 0 text, 1 image, 2 video
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def grids(self, modality: Modality) -> torch.Tensor | None:
        key = "image_grid_thw" if modality == Modality.IMAGE else "video_grid_thw"
        g = [it.model_specific_data[key] for it in self.items if it.modality == modality]
        return torch.cat(g) if g else None

    def pixels(self, modality: Modality) -> torch.Tensor | None:
        p = [it.feature for it in self.items if it.modality == modality]
        return torch.cat(p) if p else None

    def hf_inputs(self) -> dict:
        return dict(
            input_ids=self.input_ids[None], mm_token_type_ids=self.mm_token_type_ids[None],
            pixel_values=self.pixels(Modality.IMAGE), image_grid_thw=self.grids(Modality.IMAGE),
            pixel_values_videos=self.pixels(Modality.VIDEO), video_grid_thw=self.grids(Modality.VIDEO),
        )


def build_prompt(spec: list, seed: int = 0) -> Prompt:
    """spec items: int n = n random text tokens; ("image" | "video", (t, h, w)) = a wrapped media span."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    types: list[int] = []
    items = []
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(0, 100, (part,), generator=g).tolist()
            types += [0] * part
            continue
        kind, (t, h, w) = part
        num = t * h * w // MERGE**2
        is_image = kind == "image"
        ids.append(VSTART_ID)
        types.append(0)
        start = len(ids)
        ids += [IMAGE_ID if is_image else VIDEO_ID] * num
        types += [1 if is_image else 2] * num
        ids.append(VEND_ID)
        types.append(0)
        items.append(MultimodalDataItem(
            modality=Modality.IMAGE if is_image else Modality.VIDEO, hash=len(items), offsets=[(start, start + num)],
            feature=torch.randn(t * h * w, PATCH_DIM, generator=g),
            model_specific_data={("image_grid_thw" if is_image else "video_grid_thw"): torch.tensor([[t, h, w]])},
        ))
    return Prompt(torch.tensor(ids), torch.tensor(types), items)


def hf_positions(hf, prompt: Prompt) -> tuple[torch.Tensor, int]:
    """HF's rope index for one prompt: ([3, L], delta)."""
    if not prompt.items:
        n = prompt.input_ids.shape[0]
        return torch.arange(n).expand(3, -1).clone(), 0
    pos, delta = hf.model.get_rope_index(
        prompt.input_ids[None], prompt.mm_token_type_ids[None],
        image_grid_thw=prompt.grids(Modality.IMAGE), video_grid_thw=prompt.grids(Modality.VIDEO),
    )
    return pos[:, 0], int(delta.reshape(-1)[0])


def prompt_mm_embeds(model, prompt: Prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(placeholder rows [n], embeddings [n, H]) for the whole prompt; images in one call, videos in one."""
    if not prompt.items:
        return None, None
    by_item: dict[int, torch.Tensor] = {}
    for modality, fn in ((Modality.IMAGE, model.get_image_feature), (Modality.VIDEO, model.get_video_feature)):
        idx = [i for i, it in enumerate(prompt.items) if it.modality == modality]
        if idx:
            by_item.update(zip(idx, fn([prompt.items[i] for i in idx])))
    rows = torch.cat([torch.arange(s, e) for it in prompt.items for s, e in it.offsets])
    return rows, torch.cat([by_item[i] for i in range(len(prompt.items))])
