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


def check_processed_prompt_matches_hf(case: RopeVLCase, prompt: VLPrompt, hf_inputs: dict, num_new: int = 6) -> None:
    """Our model on our processor's output `prompt` gives HF's logits and greedy tokens on HF's processor
    output `hf_inputs`."""
    from tests.models.family_parity import ATOL, our_greedy, our_logits
    from tests.models.fixture_checks import MIN_MARGIN, hf_stepped_greedy

    ref_tokens, margin = hf_stepped_greedy(case.hf, hf_inputs, num_new,
                                           lambda inputs, i: case.hf_step_kwargs(prompt, inputs, i))
    assert margin > MIN_MARGIN
    with torch.inference_mode():
        ref = case.hf(**hf_inputs).logits[0]
    torch.testing.assert_close(our_logits(case, prompt, page_size=2), ref, atol=ATOL, rtol=0)
    assert our_greedy(case, [prompt], num_new, page_size=2)[0] == [ref_tokens]
