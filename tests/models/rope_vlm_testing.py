"""What the vision-language families with plain 1-D RoPE (InternVL, Pixtral) share in the parity suite: a
prompt of text tokens and image items, and a case whose HF decode steps take explicit positions.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.messages.items import MultimodalDataItem
from tests.models.family_parity import FamilyCase


@dataclass
class VLPrompt:
    input_ids: torch.Tensor  # [L]
    items: list[MultimodalDataItem] = field(default_factory=list)  # prompt order

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class RopeVLCase(FamilyCase):
    """A case of a family whose HF model takes explicit 1-D decode positions and pixels built from the items."""

    def hf_inputs(self, prompt: VLPrompt) -> dict[str, Any]:
        return {"input_ids": prompt.input_ids[None], **self.hf_pixels(prompt.items)}

    @abstractmethod
    def hf_pixels(self, items: list[MultimodalDataItem]) -> dict[str, Any]:
        """HF's pixel kwargs for `items` (none for a text-only prompt)."""

    def hf_step_kwargs(self, prompt: VLPrompt, inputs: dict, step: int) -> dict:
        return {"position_ids": torch.tensor([[len(prompt) + step]])}

