"""SigLIP (transformers' SiglipModel): CLIP's dual-encoder serving (models/clip.py) over SigLIP's towers.

Its towers end in their own heads (the text tower's linear head over the last position, the vision tower's
attention-pooling head), so there are no projections. The text tower attends bidirectionally and pools the last
position whatever it holds, so a text is never padded: texts of one length run in one call, each length its own.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tessera.models.clip import CLIPModel


class SiglipModel(CLIPModel):
    text_tower_class: ClassVar[str] = "transformers.models.siglip.modeling_siglip:SiglipTextModel"
    vision_tower_class: ClassVar[str] = "transformers.models.siglip.modeling_siglip:SiglipVisionModel"
    has_projections: ClassVar[bool] = False

    def text_features(self, input_ids: list[torch.Tensor]) -> torch.Tensor:
        """get_text_features of each prompt [B, width]: one tower call per prompt length, no padding."""
        out = torch.empty((len(input_ids), self.projection_dim), dtype=self.text_model.head.weight.dtype,
                          device=input_ids[0].device)
        by_len: dict[int, list[int]] = {}
        for i, t in enumerate(input_ids):
            by_len.setdefault(int(t.shape[0]), []).append(i)
        for rows in by_len.values():
            out[rows] = self.text_model(input_ids=torch.stack([input_ids[i] for i in rows])).pooler_output
        return out
