"""Gemma-3 processor: square SigLIP images (optionally pan-and-scan crops), mm_tokens_per_image tokens each.

The prompt holds one `<start_of_image>` (the tokenizer's boi token) per image. HF's Gemma3Processor replaces
each by the image's text, "\\n\\n<boi>" + <image_soft_token> x image_seq_length + "<eoi>\\n\\n", or with
pan-and-scan crops by "Here is the original image {that} and here are some crops to help you see better
{that} {that}...", and tokenizes the whole prompt. So placeholders live in two vocabularies: the prompt's
(boi, the `special_tokens` of the base class: counts and checks) and the expanded ids' (the soft image token,
`image_tokens`: item offsets). An item is one image with its crops: its feature is the pixel values
[1 + num_crops, 3, S, S] (original first), model_specific_data["num_crops"] a [1] int64 tensor, and it owns
1 + num_crops runs of image_seq_length soft tokens (each run attends bidirectionally in the model).

HF's processor is run as its two halves (`call_hf_processor`), because the whole one drops `num_crops`: the
image processor with Gemma3Processor's image defaults, then the tokenizer over the prompt with each image's
text in place. So a prompt is always expanded as text and tokenized whole, as HF does (newlines of the
replacement may merge with the prompt's in a real tokenizer), also when the preprocessing cache spares the
image processor; given input_ids are expanded token-wise (each boi id becomes its tokenized replacement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.assemble import build_items
from tessera.multimodal.processors.base import (
    BaseMultimodalProcessor,
    InputFormat,
    ItemFeatures,
    LoadedMultimodalData,
)
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["Gemma3Processor"]

# The pan-and-scan settings, in the order of Gemma3ImageProcessor.pan_and_scan_batched's arguments after the flag.
_PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                 "pan_and_scan_min_ratio_to_activate")


class Gemma3Processor(BaseMultimodalProcessor):
    """Gemma3ForConditionalGeneration."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        tokenizer = hf_processor.tokenizer
        self.boi_token: str = hf_processor.boi_token
        self.image_seq_length = int(hf_processor.image_seq_length)
        if self.image_seq_length != int(hf_config.mm_tokens_per_image):
            raise ValueError(f"processor image_seq_length {self.image_seq_length} != config mm_tokens_per_image "
                             f"{hf_config.mm_tokens_per_image}")
        self.full_image_sequence: str = hf_processor.full_image_sequence
        self.image_tokens = MultimodalSpecialTokens(image_token=tokenizer.image_token,
                                                    image_token_id=int(hf_config.image_token_id)).build(tokenizer)
        vision = hf_config.vision_config
        self.pixel_shape = (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(image_token=self.boi_token)

    # ------------------------------------------------------------ expansion

    def replacement(self, num_crops: int) -> str:
        """The text HF's Gemma3Processor puts in place of one image's `<start_of_image>`."""
        if not num_crops:
            return self.full_image_sequence
        return (f"Here is the original image {self.full_image_sequence} and here are some crops to help you see "
                "better " + " ".join([self.full_image_sequence] * num_crops))

    @staticmethod
    def _num_crops(feature: ItemFeatures) -> int:
        crops = feature.model_specific_data.get("num_crops")
        return int(crops.reshape(-1)[0]) if crops is not None else 0

    def expand_prompt(self, prompt: str, crops: Sequence[int]) -> str:
        """`prompt` with the i-th `<start_of_image>` replaced by the text of an image with crops[i] crops."""
        pieces = prompt.split(self.boi_token)
        if len(pieces) - 1 != len(crops):
            raise ValueError(f"prompt has {len(pieces) - 1} image placeholder(s) ({self.boi_token!r}) but "
                             f"{len(crops)} image item(s) were given")
        out = [pieces[0]]
        for c, piece in zip(crops, pieces[1:]):
            out += [self.replacement(c), piece]
        return "".join(out)

    def _image_kwargs(self) -> dict[str, Any]:
        # Gemma3Processor's own image defaults (pan-and-scan off, its crop sizes) win over the image
        # processor's saved settings, as in HF's kwargs merge; the request's kwargs win over both.
        return {**dict(getattr(type(self.hf_processor), "images_kwargs", {})), **self.hf_kwargs(Modality.IMAGE)}

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """One square crop, plus with pan-and-scan the crops the image processor's own `pan_and_scan_batched`
        cuts from a zero-stride stand-in of the image's shape (it only slices, so the count is exact)."""
        ip = self.hf_processor.image_processor
        kwargs = self._image_kwargs()
        if is_pil_backend(ip) or not hasattr(ip, "pan_and_scan_batched") \
                or set(self.hf_kwargs(Modality.IMAGE)) - SHAPE_NEUTRAL_KWARGS - set(_PAN_AND_SCAN):
            return None
        setting = lambda name: kwargs[name] if kwargs.get(name) is not None else getattr(ip, name, None)  # noqa: E731
        c, h, w = self.pixel_shape
        crops = 0
        if setting("do_pan_and_scan"):
            stand_in = torch.zeros((), dtype=torch.uint8).expand(1, c, height, width)
            crops = len(ip.pan_and_scan_batched(stand_in, *(setting(name) for name in _PAN_AND_SCAN[1:])))
        return ImagePlan((1 + crops) * self.image_seq_length, {"num_crops": torch.tensor([crops])},
                         (1 + crops) * c * h * w * 4)

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        """HF's Gemma3Processor in two parts, as it runs them: its image processor (whose `num_crops` the full
        processor drops), then the tokenizer over the prompt with each image's text in place."""
        out: dict[str, Any] = {}
        crops: list[int] = []
        if loaded.images:
            image_processor = self.hf_processor.image_processor
            out.update(image_processor(loaded.images, return_tensors="pt", **self._image_kwargs(),
                                       **self.image_call_kwargs()))
            crops = self._crops(out, None, "image processor output")
        if prompt is not None:
            out["input_ids"] = torch.tensor([self.tokenize(self.expand_prompt(prompt, crops))])
        return out

    def _is_expanded(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> bool:
        return self.image_tokens.count_ids(input_ids)[Modality.IMAGE] == sum(f.num_tokens for f in features)

    def _process_raw(self, prompt: str | None, input_ids: list[int] | None, loaded: LoadedMultimodalData,
                     ) -> tuple[list[int], list[ItemFeatures], list[int]]:
        ids, features, hashes = super()._process_raw(prompt, input_ids, loaded)
        if prompt is not None and not self._is_expanded(ids, features):  # ids of the bare prompt (cache hit)
            ids = self.tokenize(self.expand_prompt(prompt, [self._num_crops(f) for f in features]))
        return ids, features, hashes

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """`input_ids` unchanged when already expanded, else each boi id replaced by its item's tokenized
        replacement text."""
        if not features or self._is_expanded(input_ids, features):
            if not features and self.image_tokens.count_ids(input_ids)[Modality.IMAGE]:
                raise ValueError("input_ids have image tokens but no image items were given")
            return list(input_ids)
        boi_id = self.special_tokens.image_token_id
        found = sum(1 for t in input_ids if t == boi_id)
        if found != len(features):
            raise ValueError(f"input_ids have {found} image placeholder(s) ({self.boi_token!r}); expected "
                             f"{len(features)} (one per image item) or already-expanded image tokens")
        tokenizer = getattr(self.hf_processor, "tokenizer", self.hf_processor)
        runs = iter(features)
        out: list[int] = []
        for t in input_ids:
            if t == boi_id:
                text = self.replacement(self._num_crops(next(runs)))
                out += list(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                out.append(t)
        if not self._is_expanded(out, features):
            raise ValueError("the expanded input_ids do not hold the image tokens their items need")
        return out

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        return build_items(input_ids, features, hashes, self.image_tokens)

    # ------------------------------------------------------------ splitting

    def _split_pixels(self, pixels: torch.Tensor, crops: list[int], what: str) -> list[ItemFeatures]:
        total = sum(1 + c for c in crops)
        if pixels.ndim != 4 or pixels.shape[0] != total or tuple(pixels.shape[1:]) != self.pixel_shape \
                or not pixels.is_floating_point():
            raise ValueError(f"{what} pixel_values has shape {tuple(pixels.shape)} ({pixels.dtype}); "
                             f"{len(crops)} image(s) with num_crops {crops} need floating-point "
                             f"[{total}, {', '.join(map(str, self.pixel_shape))}]")
        out = []
        # clone(): a slice view would drag the whole batch's storage along when the item is sent on.
        for chunk, c in zip(pixels.split([1 + c for c in crops]), crops):
            out.append(ItemFeatures(Modality.IMAGE, (1 + c) * self.image_seq_length, feature=chunk.clone(),
                                    model_specific_data={"num_crops": torch.tensor([c])}))
        return out

    @staticmethod
    def _crops(data: Mapping[str, Any], num_images: int | None, what: str) -> list[int]:
        if data.get("num_crops") is None:
            if num_images is None:
                raise ValueError(f"{what} image data needs 'num_crops' to tell images from crops")
            return [0] * num_images
        crops = [int(c) for c in _tensor(data["num_crops"], "num_crops").reshape(-1).tolist()]
        if any(c < 0 for c in crops):
            raise ValueError(f"num_crops must be non-negative, got {crops}")
        return crops

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        if not loaded.images:
            return []
        crops = self._crops(hf_output, None, "HF processor output")
        assert len(crops) == len(loaded.images), f"HF processor returned {len(crops)} images for {len(loaded.images)}"
        return self._split_pixels(_tensor(hf_output["pixel_values"], "pixel_values"), crops, "HF processor output")

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        what = input_format.value
        if input_format is InputFormat.PROCESSOR_OUTPUT:
            if data.get("pixel_values") is None:
                raise ValueError(f"{what} image data needs 'pixel_values'")
            pixels = _tensor(data["pixel_values"], "pixel_values")
            crops = self._crops(data, int(pixels.shape[0]) if pixels.ndim == 4 else 1, what)
            return self._split_pixels(pixels, crops, what)
        if data.get("feature") is None:
            raise ValueError(f"{what} image data needs 'feature' (the projector's output)")
        feature = data["feature"]
        if isinstance(feature, (list, tuple)):  # per image: [(1 + crops) * tokens, H] or [1 + crops, tokens, H]
            chunks = [_tensor(f, "feature") for f in feature]
            chunks = [c.reshape(-1, c.shape[-1]) for c in chunks]
            crops = self._crops(data, len(chunks), what)
        else:  # [images and crops, tokens, H] or [rows, H]; without num_crops every image stands alone
            emb = _tensor(feature, "feature")
            crops = self._crops(data, int(emb.shape[0]) if emb.ndim == 3 else 1, what)
            flat = emb.reshape(-1, emb.shape[-1])
            wanted = [(1 + c) * self.image_seq_length for c in crops]
            chunks = list(flat.split(wanted)) if flat.shape[0] == sum(wanted) else [flat]
        rows = [(1 + c) * self.image_seq_length for c in crops]
        if [c.shape[0] for c in chunks] != rows or \
                any(c.shape[1] != self.embed_dim or not c.is_floating_point() for c in chunks):
            raise ValueError(f"precomputed image features have shapes {[tuple(c.shape) for c in chunks]}; "
                             f"num_crops {crops} need floating-point rows {rows} of {self.embed_dim} values")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c.clone(),
                             model_specific_data={"num_crops": torch.tensor([k])})
                for c, n, k in zip(chunks, rows, crops)]
