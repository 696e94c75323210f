"""Qwen2-VL (and Qwen2.5-VL) processor: images and videos as merged ViT patches, M-RoPE positions.

An item of grid (t, h, w) owns t*h*w rows of `pixel_values` / `pixel_values_videos` (one row
per 14x14xtemporal patch) and t*h*w / merge**2 placeholder tokens. The item's
model_specific_data holds its grid as a [1, 3] int64 tensor under `image_grid_thw` or
`video_grid_thw` (and `second_per_grid_ts` for Qwen2.5-VL videos when the HF processor gives it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend
from tessera.messages.items import Modality, MultimodalInputs
from tessera.multimodal.media import VideoClip
from tessera.multimodal.mrope import VisionSpan, compute_mrope_positions
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import (
    BaseMultimodalProcessor,
    InputFormat,
    ItemFeatures,
    LoadedMultimodalData,
)
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["QwenVLProcessor", "temporal_patch_size"]


def temporal_patch_size(vision_config: Any) -> int:
    """Frames per patch: the config's, or 1 for towers that patch frame by frame and have no such field
    (Cosmos3 Edge's SigLIP2 tower)."""
    return int(getattr(vision_config, "temporal_patch_size", 1))

_KEYS = {  # modality -> (pixel key, grid key)
    Modality.IMAGE: ("pixel_values", "image_grid_thw"),
    Modality.VIDEO: ("pixel_values_videos", "video_grid_thw"),
}


class QwenVLProcessor(BaseMultimodalProcessor):
    """Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE, Modality.VIDEO})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        vision = hf_config.vision_config
        self.spatial_merge_size = int(vision.spatial_merge_size)
        # Qwen2.5-VL spaces temporal positions by real time; Qwen2-VL has no such field.
        self.tokens_per_second: float | None = getattr(vision, "tokens_per_second", None)
        # What the language model and the vision tower accept, checked on caller-supplied tensors
        # here: a mismatch found in the scheduler process would fail a whole batch.
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", getattr(vision, "num_channels", 3))))
        self.patch_dim = channels * temporal_patch_size(vision) * int(vision.patch_size) ** 2
        merge = int(getattr(hf_processor.image_processor, "merge_size", self.spatial_merge_size))
        if merge != self.spatial_merge_size:
            raise ValueError(f"image processor merge_size {merge} != vision_config.spatial_merge_size "
                             f"{self.spatial_merge_size}")
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(
            image_token=getattr(self.hf_processor, "image_token", "<|image_pad|>"),
            video_token=getattr(self.hf_processor, "video_token", "<|video_pad|>"),
            image_token_id=getattr(self.hf_config, "image_token_id", None),
            video_token_id=getattr(self.hf_config, "video_token_id", None),
        )

    # ------------------------------------------------------------ kwargs

    def _sub_processor(self, modality: Modality) -> Any:
        if modality is Modality.VIDEO:
            return getattr(self.hf_processor, "video_processor", None) or self.hf_processor.image_processor
        return self.hf_processor.image_processor

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        """max_pixels / min_pixels become the processor's size dict {longest_edge, shortest_edge}
        (transformers 5 dropped the pixel kwargs); video frames are sampled at load time."""
        kwargs = super().hf_kwargs(modality)
        if modality not in _KEYS:
            return kwargs
        default = self._sub_processor(modality).size
        size = dict(kwargs.pop("size", None) or {})
        size.setdefault("longest_edge", default["longest_edge"])
        size.setdefault("shortest_edge", default["shortest_edge"])
        if "max_pixels" in kwargs:
            size["longest_edge"] = int(kwargs.pop("max_pixels"))
        if "min_pixels" in kwargs:
            size["shortest_edge"] = int(kwargs.pop("min_pixels"))
        kwargs["size"] = size
        if modality is Modality.VIDEO:
            kwargs["do_sample_frames"] = False
        return kwargs

    def video_call_kwargs(self, videos: Sequence[VideoClip]) -> dict[str, Any]:
        """Qwen2.5-VL spaces temporal positions by seconds per grid (temporal_patch_size / the
        sampled frame rate), which the HF processor reads from video metadata."""
        if self.tokens_per_second is None or any(clip.fps is None for clip in videos):
            return {}
        return {"video_metadata": [
            {"fps": clip.fps, "total_num_frames": clip.total_num_frames, "frames_indices": clip.sampled_indices}
            for clip in videos
        ]}

    def feature_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().feature_kwargs(modality)
        sub = self._sub_processor(modality)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            kwargs.setdefault(name, getattr(sub, name, None))
        return kwargs

    # ------------------------------------------------------------ deferred images

    def resized(self, height: int, width: int, size: Mapping[str, int]) -> tuple[int, int] | None:
        """The (height, width) the image processor resizes an image to (HF's own `smart_resize`), or None where
        that processor is not the one modelled here."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize

        ip = self.hf_processor.image_processor
        if not isinstance(ip, Qwen2VLImageProcessor):
            return None
        return smart_resize(height, width, factor=int(ip.patch_size) * int(ip.merge_size),
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """The grid the image processor makes: its resize to multiples of patch * merge within
        [shortest_edge, longest_edge] pixels (`resized`), then one row of patch_dim values per patch."""
        ip = self.hf_processor.image_processor
        kwargs = self.hf_kwargs(Modality.IMAGE)
        if is_pil_backend(ip) or not getattr(ip, "do_resize", True) or set(kwargs) - {"size"} - SHAPE_NEUTRAL_KWARGS:
            return None
        patch, merge = int(ip.patch_size), int(ip.merge_size)
        try:
            resized = self.resized(height, width, kwargs["size"])
            if resized is None:
                return None
            h, w = resized
        except ValueError:  # extreme aspect ratios: the eager path raises the processor's own error
            return None
        grid = torch.tensor([[1, h // patch, w // patch]], dtype=torch.long)
        rows = (h // patch) * (w // patch)
        return ImagePlan(rows // merge**2, {"image_grid_thw": grid}, rows * self.patch_dim * 4)

    # ------------------------------------------------------------ splitting

    def _tokens_per_item(self, grids: torch.Tensor) -> list[int]:
        merge = self.spatial_merge_size
        # The tower merges merge x merge patch blocks, so h and w (not only h*w) must divide.
        if bool((grids[:, 1:] % merge != 0).any()):
            raise ValueError(f"grid_thw {grids.tolist()}: h and w must be multiples of merge_size = {merge}")
        return (grids.prod(-1) // merge**2).tolist()

    def _grids(self, data: Mapping[str, Any], modality: Modality, what: str) -> torch.Tensor:
        grid_key = _KEYS[modality][1]
        if data.get(grid_key) is None:
            raise ValueError(f"{what} {modality.value} data needs {grid_key!r}")
        grids = _tensor(data[grid_key], grid_key).reshape(-1, 3).to(torch.long)
        if grids.shape[0] == 0 or bool((grids <= 0).any()):
            raise ValueError(f"{grid_key} must hold positive (t, h, w) rows, got {grids.tolist()}")
        return grids

    def _split_pixels(self, data: Mapping[str, Any], modality: Modality, grids: torch.Tensor,
                      extra: dict[str, torch.Tensor] | None = None, owned: bool = False) -> list[ItemFeatures]:
        """One ItemFeatures per grid row. owned: `data` is a fresh output of ours (the HF processor's), not a
        caller's tensor, which is always copied."""
        pixel_key, grid_key = _KEYS[modality]
        if data.get(pixel_key) is None:
            raise ValueError(f"{modality.value} data needs {pixel_key!r}")
        pixels = _tensor(data[pixel_key], pixel_key)
        rows = grids.prod(-1).tolist()
        if pixels.ndim != 2 or pixels.shape[0] != sum(rows):
            raise ValueError(f"{pixel_key} has shape {tuple(pixels.shape)}; {grid_key} needs {sum(rows)} rows")
        if pixels.shape[1] != self.patch_dim or not pixels.is_floating_point():
            raise ValueError(f"{pixel_key} has shape {tuple(pixels.shape)} ({pixels.dtype}); the vision tower "
                             f"takes floating-point rows of {self.patch_dim} values")
        out = []
        # clone(): a slice view would drag the whole batch's storage along when the item is sent on. A single
        # item of our own output is that whole tensor already (its copy was ~10% of the frontend's
        # preprocessing, page faults mostly: a fresh 1.2 MB per demo-vl image).
        for i, (grid, chunk, n) in enumerate(zip(grids, pixels.split(rows), self._tokens_per_item(grids))):
            msd = {grid_key: grid.view(1, 3).clone()}
            msd.update({k: v[i: i + 1].clone() for k, v in (extra or {}).items()})
            feature = chunk if owned and len(rows) == 1 else chunk.clone()
            out.append(ItemFeatures(modality, n, feature=feature, model_specific_data=msd))
        return out

    def _second_per_grid(self, data: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if self.tokens_per_second is None or data.get("second_per_grid_ts") is None:
            return {}
        return {"second_per_grid_ts": _tensor(data["second_per_grid_ts"], "second_per_grid_ts").reshape(-1).float()}

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        out = []
        for modality, n in ((Modality.IMAGE, len(loaded.images)), (Modality.VIDEO, len(loaded.videos))):
            if n == 0:
                continue
            grids = self._grids(hf_output, modality, "HF processor output")
            assert grids.shape[0] == n, f"HF processor returned {grids.shape[0]} grids for {n} {modality.value}s"
            extra = self._second_per_grid(hf_output) if modality is Modality.VIDEO else {}
            out += self._split_pixels(hf_output, modality, grids, extra, owned=True)
        return out

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        what = input_format.value
        grids = self._grids(data, modality, what)
        extra = self._second_per_grid(data) if modality is Modality.VIDEO else {}
        if input_format is InputFormat.PROCESSOR_OUTPUT:
            return self._split_pixels(data, modality, grids, extra)
        return self._split_embeddings(data, modality, grids, extra)

    def _split_embeddings(self, data: Mapping[str, Any], modality: Modality, grids: torch.Tensor,
                          extra: dict[str, torch.Tensor]) -> list[ItemFeatures]:
        grid_key = _KEYS[modality][1]
        if data.get("feature") is None:
            raise ValueError(f"precomputed_embedding {modality.value} data needs 'feature' (encoder output)")
        tokens = self._tokens_per_item(grids)
        feature = data["feature"]
        if isinstance(feature, (list, tuple)):
            chunks = [_tensor(f, "feature") for f in feature]
        else:
            emb = _tensor(feature, "feature")
            while emb.ndim > 2 and emb.shape[0] == 1:
                emb = emb[0]
            if emb.ndim != 2 or emb.shape[0] != sum(tokens):
                raise ValueError(
                    f"precomputed {modality.value} feature has shape {tuple(emb.shape)}; "
                    f"{grid_key} needs [{sum(tokens)}, hidden]"
                )
            chunks = [c.clone() for c in emb.split(tokens)]
        if len(chunks) != len(tokens) or any(c.ndim != 2 or c.shape[0] != n for c, n in zip(chunks, tokens)):
            raise ValueError(
                f"precomputed {modality.value} features have shapes {[tuple(c.shape) for c in chunks]}; "
                f"{grid_key} needs {tokens} rows"
            )
        if any(c.shape[1] != self.embed_dim or not c.is_floating_point() for c in chunks):
            raise ValueError(
                f"precomputed {modality.value} features have shapes {[tuple(c.shape) for c in chunks]} "
                f"({chunks[0].dtype}); the language model takes floating-point rows of {self.embed_dim} values"
            )
        out = []
        for i, (grid, chunk, n) in enumerate(zip(grids, chunks, tokens)):
            msd = {grid_key: grid.view(1, 3).clone()}
            msd.update({k: v[i: i + 1].clone() for k, v in extra.items()})
            out.append(ItemFeatures(modality, n, precomputed_embedding=chunk, model_specific_data=msd))
        return out

    # ------------------------------------------------------------ positions

    def finalize(self, input_ids: list[int], mm_inputs: MultimodalInputs) -> None:
        """Fill mrope_positions [3, len(input_ids)] and mrope_position_delta."""
        spans = []
        for item in mm_inputs.items:
            grid_key = _KEYS[item.modality][1]
            grid = item.model_specific_data[grid_key].view(3).tolist()
            if len(item.offsets) != 1:
                raise ValueError(f"a {item.modality.value} item's placeholder tokens must be contiguous, "
                                 f"got runs {item.offsets}")
            interval = 1.0
            if item.modality is Modality.VIDEO and self.tokens_per_second is not None:
                spg = item.model_specific_data.get("second_per_grid_ts")
                interval = self.tokens_per_second * (float(spg.view(-1)[0]) if spg is not None else 1.0)
            spans.append(VisionSpan(item.offsets[0][0], (grid[0], grid[1], grid[2]), interval))
        positions, delta = compute_mrope_positions(len(input_ids), spans, self.spatial_merge_size)
        mm_inputs.mrope_positions = positions
        mm_inputs.mrope_position_delta = delta
