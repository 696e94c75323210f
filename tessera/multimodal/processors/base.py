"""The multimodal processor contract: media references in, expanded input_ids + items out.

Pipeline (one hand-off type per step):
  `load_mm_data_sync(image_data, video_data, audio_data)` -> LoadedMultimodalData  (I/O, concurrent)
  `process_and_combine_mm_data(prompt, input_ids, loaded)` -> ProcessorOutput  (CPU, worker thread)

Contracts every subclass keeps:
- `ProcessorOutput.input_ids` holds exactly `item.num_tokens` placeholder ids per item, and
  `item.offsets` are their [start, end) runs; items are in prompt order.
- One input format per request (raw media, "processor_output" dicts, "precomputed_embedding"
  dicts); mixing raises ValueError. Item limits, unsupported modalities and language-model-only
  mode raise ValueError naming the modality before any media is loaded.
- An item's hash covers its original content (decoded pixels/frames/samples, or the given
  tensors) and the effective feature-shaping kwargs. The same hash keys the preprocessing
  cache (raw items only), so a repeated item skips the HF processor; the output (ids,
  offsets, features) is the same with or without a cache hit.
- Thread-safe: one instance serves the frontend's worker pool concurrently.
- Deferred preprocessing (`defer_images=True`; the server turns it on): a raw image whose family can tell its
  placeholder count and model_specific_data from its size alone (`plan_image`) is sent as uint8
  pixels + config (`DeferredImage`) when that is no larger than the processed features and those reach
  `defer_min_feature_bytes` (the server: DEFER_MIN_FEATURE_BYTES); the worker
  that encodes it runs `materialize_images` (the same HF processor call) just before encoding.
  Its hash is the eager item's, so prefix and encoder caches are shared by both paths.
"""

from __future__ import annotations

import abc
import concurrent.futures
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tessera.multimodal.deferred import ImagePlan, defer_image
from tessera.multimodal.hashing import hash_item
from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.multimodal.media import (
    MediaLimits,
    VideoClip,
    load_audio,
    load_image,
    load_video,
)
from tessera.multimodal.processors.assemble import (
    ItemFeatures,
    ProcessorOutput,
    build_items,
    expand_placeholders,
)
from tessera.multimodal.processors.loaded import (
    InputFormat,
    LoadedMultimodalData,
    as_list,
)
from tessera.multimodal.processors.preprocess_cache import (
    PreprocessCache,
    PreprocessCacheStats,
)
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["BaseMultimodalProcessor", "InputFormat", "ItemFeatures", "LoadedMultimodalData", "ProcessorOutput"]

# mm_process_config keys consumed by the loader (frame sampling), not passed to HF.
VIDEO_LOADER_KEYS = ("fps", "max_frames", "num_frames")


class BaseMultimodalProcessor(abc.ABC):
    """Wraps one HF processor for one architecture. Subclasses define the placeholders and
    how the HF output splits into items (`build_special_tokens`, `split_hf_output`,
    `split_preprocessed`), and may post-process (`finalize`, e.g. M-RoPE positions)."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset()
    # The HF processor writes a text-only prompt its own way (Mllama's puts BOS in): the frontend tokenizes text
    # prompts without media through `process` too, not with the bare tokenizer.
    tokenizes_text: ClassVar[bool] = False

    def __init__(self, hf_processor: Any, hf_config: Any, mm_process_config: Mapping[str, Any] | None = None,
                 limits: MediaLimits | None = None, limit_mm_per_request: Mapping[str, int] | None = None, *,
                 language_model_only: bool = False, io_workers: int = 8, cache_size_bytes: int = 0,
                 defer_images: bool = False, defer_min_feature_bytes: int = 0) -> None:
        self.hf_processor = hf_processor
        self.hf_config = hf_config
        self.limits = limits if limits is not None else MediaLimits()
        self.language_model_only = language_model_only
        self.mm_process_config = self._validate_process_config(mm_process_config or {})
        self.limit_mm_per_request = self._validate_item_limits(limit_mm_per_request or {})
        self.special_tokens = self.build_special_tokens().build(hf_processor)
        feature_extractor = getattr(hf_processor, "feature_extractor", None)
        self.audio_sampling_rate = int(getattr(feature_extractor, "sampling_rate", 16000))
        self._io_workers = io_workers
        self._io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._io_pool_lock = threading.Lock()  # worker threads create the pool lazily
        self.preprocess_cache = PreprocessCache(cache_size_bytes)
        self.defer_images = defer_images
        self.defer_min_feature_bytes = defer_min_feature_bytes  # smaller features are processed eagerly
        # Where the image processor runs when materialising deferred images (the worker sets its device).
        self.image_device: str | None = None

    # ------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def build_special_tokens(self) -> MultimodalSpecialTokens:
        """This model's placeholders (unbuilt; the base calls `build`)."""

    @abc.abstractmethod
    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        """Per-item features of an HF processor output, images then videos then audios, each in input order."""

    @abc.abstractmethod
    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        """Per-item features of one caller-supplied processor_output / precomputed_embedding dict."""

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        """Kwargs for the HF processor's images_kwargs / videos_kwargs / audio_kwargs."""
        kwargs = dict(self.mm_process_config.get(modality, {}))
        if modality is Modality.VIDEO:
            for key in VIDEO_LOADER_KEYS:
                kwargs.pop(key, None)
        if modality is Modality.AUDIO:
            kwargs["sampling_rate"] = self.audio_sampling_rate
        return kwargs

    def feature_kwargs(self, modality: Modality) -> dict[str, Any]:
        """Everything that shapes an item's features besides its content: hashed with it."""
        sub = {Modality.IMAGE: "image_processor", Modality.VIDEO: "video_processor",
               Modality.AUDIO: "feature_extractor"}[modality]
        kwargs = {"processor": type(getattr(self.hf_processor, sub, None)).__name__, **self.hf_kwargs(modality)}
        if modality is Modality.VIDEO:
            kwargs.update(self.video_sampling_kwargs())
        return kwargs

    def video_call_kwargs(self, videos: Sequence[VideoClip]) -> dict[str, Any]:
        """Per-request videos_kwargs derived from the loaded clips (e.g. their metadata); default none."""
        return {}

    def finalize(self, input_ids: list[int], mm_inputs: MultimodalInputs) -> None:
        """Model-specific additions to the output (positions, ...); default none."""

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """The cheap half of deferred preprocessing: what the image processor will make of a height x width
        image (placeholder count, model_specific_data, bytes of its features), computed by the HF processor's
        own resize rules without touching pixels. None keeps the image eager: the default, and the answer
        whenever the configured kwargs are ones the plan does not model."""
        return None

    def image_call_kwargs(self) -> dict[str, Any]:
        """Kwargs added to every image-processor call that must not change the features or their hash."""
        return {"device": self.image_device} if self.image_device else {}

    def materialize_images(self, pixels: Sequence[Any]) -> list[ItemFeatures]:
        """The expensive half: the features of deferred images (uint8 [C, H, W] tensors), by the same HF
        processor call and split as the eager path's cache misses."""
        loaded = LoadedMultimodalData(InputFormat.RAW, images=list(pixels))
        return self.split_hf_output(self.call_hf_processor(None, loaded), loaded)

    # ------------------------------------------------------------ configuration

    @staticmethod
    def _validate_process_config(config: Mapping[str, Any]) -> dict[Modality, dict[str, Any]]:
        out: dict[Modality, dict[str, Any]] = {}
        for key, value in config.items():
            try:
                modality = Modality(key)
            except ValueError:
                raise ValueError(f"mm_process_config has unknown modality {key!r} (use image, video, audio)") from None
            if not isinstance(value, Mapping):
                raise ValueError(f"mm_process_config[{key!r}] must be a dict, got {type(value).__name__}")
            for name in ("max_pixels", "min_pixels", "fps", "max_frames", "num_frames"):
                if name in value and not (isinstance(value[name], (int, float)) and value[name] > 0):
                    raise ValueError(f"mm_process_config[{key!r}][{name!r}] must be positive, got {value[name]!r}")
            if value.get("min_pixels", 0) > value.get("max_pixels", float("inf")):
                raise ValueError(f"mm_process_config[{key!r}]: min_pixels exceeds max_pixels")
            out[modality] = dict(value)
        return out

    @staticmethod
    def _validate_item_limits(limits: Mapping[str, int]) -> dict[Modality, int]:
        out: dict[Modality, int] = {}
        for key, value in limits.items():
            try:
                modality = Modality(key)
            except ValueError:
                raise ValueError(f"limit_mm_per_request has unknown modality {key!r}") from None
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"limit_mm_per_request[{key!r}] must be a non-negative int, got {value!r}")
            out[modality] = value
        return out

    def video_sampling_kwargs(self) -> dict[str, Any]:
        video = self.mm_process_config.get(Modality.VIDEO, {})
        return {k: video[k] for k in VIDEO_LOADER_KEYS if video.get(k) is not None}

    # ------------------------------------------------------------ loading

    def _check_request(self, entries: dict[Modality, list[Any]]) -> InputFormat:
        """Validate modalities, item counts and the single input format; returns that format."""
        given = {m: len(es) for m, es in entries.items() if es}
        if given and self.language_model_only:
            raise ValueError(
                f"the server runs in language-model-only mode; {', '.join(m.value for m in given)} "
                "inputs are refused"
            )
        formats: set[InputFormat] = set()
        for modality, items in entries.items():
            if items and modality not in self.supported_modalities:
                raise ValueError(f"{type(self).__name__} does not accept {modality.value} inputs")
            for entry in items:
                formats.add(self._entry_format(entry))
        if len(formats) > 1:
            names = ", ".join(sorted(f.value for f in formats))
            raise ValueError(f"one input format per request; got a mix of {names}")
        input_format = formats.pop() if formats else InputFormat.RAW
        if input_format is InputFormat.RAW:
            self._check_item_limits(given)
        return input_format

    @staticmethod
    def _entry_format(entry: Any) -> InputFormat:
        if not isinstance(entry, Mapping):
            return InputFormat.RAW
        fmt = entry.get("format")
        if fmt in (InputFormat.PROCESSOR_OUTPUT.value, InputFormat.PRECOMPUTED_EMBEDDING.value):
            return InputFormat(fmt)
        raise ValueError(
            f"a dict media item needs format='processor_output' or 'precomputed_embedding', got format={fmt!r}"
        )

    def _check_item_limits(self, counts: Mapping[Modality, int]) -> None:
        for modality, n in counts.items():
            limit = self.limit_mm_per_request.get(modality)
            if limit is not None and n > limit:
                raise ValueError(f"too many {modality.value} items: {n} given, at most {limit} per request "
                                 f"(--limit-mm-data-per-request)")

    def _load_one(self, modality: Modality, src: Any, video_kwargs: Mapping[str, Any] | None = None) -> Any:
        if modality is Modality.IMAGE:
            return load_image(src, limits=self.limits)
        if modality is Modality.VIDEO:  # a request's own num_frames/fps/max_frames win over the server's
            return load_video(src, limits=self.limits, **{**self.video_sampling_kwargs(), **(video_kwargs or {})})
        return load_audio(src, limits=self.limits, sampling_rate=self.audio_sampling_rate)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._io_pool_lock:
            if self._io_pool is None:
                self._io_pool = concurrent.futures.ThreadPoolExecutor(self._io_workers,
                                                                      thread_name_prefix="tessera-media")
            return self._io_pool

    def _start_loading(self, image_data: Any, video_data: Any, audio_data: Any,
                       ) -> tuple[LoadedMultimodalData, list[tuple[Modality, Any]]]:
        entries = {Modality.IMAGE: as_list(image_data), Modality.VIDEO: as_list(video_data),
                   Modality.AUDIO: as_list(audio_data)}
        input_format = self._check_request(entries)
        loaded = LoadedMultimodalData(input_format)
        if input_format is not InputFormat.RAW:
            loaded.preprocessed = {m: es for m, es in entries.items() if es}
            return loaded, []
        return loaded, [(m, e) for m, es in entries.items() for e in es]

    @staticmethod
    def _store(loaded: LoadedMultimodalData, jobs: Sequence[tuple[Modality, Any]], results: Sequence[Any]) -> None:
        for (modality, _), result in zip(jobs, results):
            {Modality.IMAGE: loaded.images, Modality.VIDEO: loaded.videos, Modality.AUDIO: loaded.audios}[
                modality].append(result)

    def load_mm_data_sync(self, image_data: Any = None, video_data: Any = None,
                          audio_data: Any = None, video_kwargs: Mapping[str, Any] | None = None,
                          ) -> LoadedMultimodalData:
        """Load every item concurrently on the media thread pool; the first failure propagates (MediaError /
        ValueError). Each *_data is one item or a list of items. Called from the frontend's worker threads; must
        not be called from the media pool itself (it waits on that pool). video_kwargs: this request's frame
        sampling."""
        loaded, jobs = self._start_loading(image_data, video_data, audio_data)
        results = list(self._pool().map(lambda job: self._load_one(*job, video_kwargs), jobs))
        self._store(loaded, jobs, results)
        return loaded

    # ------------------------------------------------------------ processing

    def has_placeholders(self, prompt: str) -> bool:
        """Whether `prompt` contains any media placeholder of this model."""
        return any(self.special_tokens.count(prompt).values())

    def tokenize(self, prompt: str) -> list[int]:
        tokenizer = getattr(self.hf_processor, "tokenizer", self.hf_processor)
        return list(tokenizer(prompt)["input_ids"])

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        """The HF processor over all raw media (and the prompt, when given) in one call."""
        kwargs: dict[str, Any] = {"return_tensors": "pt"}
        if prompt is not None:
            kwargs["text"] = [prompt]
        if loaded.images:
            kwargs["images"] = loaded.images
            kwargs["images_kwargs"] = {**self.hf_kwargs(Modality.IMAGE), **self.image_call_kwargs()}
        if loaded.videos:
            kwargs["videos"] = [clip.frames for clip in loaded.videos]
            kwargs["videos_kwargs"] = {**self.hf_kwargs(Modality.VIDEO), **self.video_call_kwargs(loaded.videos)}
        if loaded.audios:
            kwargs["audio"] = loaded.audios
            kwargs["audio_kwargs"] = self.hf_kwargs(Modality.AUDIO)
        return self.hf_processor(**kwargs)

    def process_and_combine_mm_data(self, prompt: str | None, input_ids: list[int] | None,
                                    loaded: LoadedMultimodalData) -> ProcessorOutput:
        """Expanded input_ids and items for exactly one of `prompt` / `input_ids`.

        Raw media with a prompt and no preprocessing-cache hit goes through the HF processor as
        one call (its expansion is the reference); otherwise the HF processor sees only the
        uncached media and the placeholders are expanded here (`_process_raw`). Preprocessed
        formats never call the HF processor.
        `input_ids` may hold one placeholder per item or already-expanded runs.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        features: list[ItemFeatures] = []
        hashes: list[int] = []
        if loaded.is_empty:
            if prompt is not None:
                self.special_tokens.check_counts(prompt, {})  # placeholders without media
            ids = self.tokenize(prompt) if prompt is not None else list(input_ids or [])
        elif loaded.input_format is InputFormat.RAW:
            if prompt is not None:
                self.special_tokens.check_counts(prompt, loaded.raw_counts())
            ids, features, hashes = self._process_raw(prompt, input_ids, loaded)
        else:
            ids = self.tokenize(prompt) if prompt is not None else list(input_ids or [])
            features = [f for m, entries in loaded.preprocessed.items() for entry in entries
                        for f in self.split_preprocessed(m, entry, loaded.input_format)]
            counts: dict[Modality, int] = {}
            for f in features:
                counts[f.modality] = counts.get(f.modality, 0) + 1
            self._check_item_limits(counts)
            hashes = [hash_item([f.feature, f.precomputed_embedding, f.model_specific_data],
                                {"format": loaded.input_format.value}) for f in features]
        ids = self.expand_placeholders(ids, features)
        items = self._build_items(ids, features, hashes)
        mm_inputs = MultimodalInputs(items=items)
        self.finalize(ids, mm_inputs)
        return ProcessorOutput(input_ids=ids, mm_inputs=mm_inputs)

    def process(self, prompt: str | None = None, input_ids: list[int] | None = None, image_data: Any = None,
                video_data: Any = None, audio_data: Any = None,
                video_kwargs: Mapping[str, Any] | None = None) -> ProcessorOutput:
        """Load and process synchronously (for frontend worker threads)."""
        loaded = self.load_mm_data_sync(image_data, video_data, audio_data, video_kwargs)
        return self.process_and_combine_mm_data(prompt, input_ids, loaded)
    def close(self) -> None:
        with self._io_pool_lock:
            if self._io_pool is not None:
                self._io_pool.shutdown(wait=False, cancel_futures=True)
                self._io_pool = None

    # ------------------------------------------------------------ items

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        return expand_placeholders(input_ids, features, self.special_tokens)

    def _raw_hashes(self, loaded: LoadedMultimodalData) -> list[int]:
        """Item hashes in `split_hf_output` order: images, videos, audios, each in input order."""
        kwargs = {m: self.feature_kwargs(m) for m, n in loaded.raw_counts().items() if n}
        hashes = [hash_item(image, kwargs[Modality.IMAGE]) for image in loaded.images]
        # The sampled rate can shape positions (Qwen2.5-VL), so equal frames at other rates differ.
        hashes += [hash_item([clip.frames, clip.sampled_fps], kwargs[Modality.VIDEO]) for clip in loaded.videos]
        hashes += [hash_item(audio, kwargs[Modality.AUDIO]) for audio in loaded.audios]
        return hashes

    def _process_raw(self, prompt: str | None, input_ids: list[int] | None, loaded: LoadedMultimodalData,
                     ) -> tuple[list[int], list[ItemFeatures], list[int]]:
        """(ids, features, hashes) of raw media: features from the preprocessing cache where it
        has them, from one HF processor call over the other items.

        With a prompt and no hit, that call includes the prompt and its ids are the reference.
        Otherwise the ids are the prompt's tokens (or the given input_ids), expanded later by
        `expand_placeholders`: the same ids, since each placeholder is a single special token
        whose run the HF processor would tokenize as N copies of itself.
        """
        hashes = self._raw_hashes(loaded)
        # Deferred images first: they are the cheapest to send and never reach the HF processor here.
        found: list[ItemFeatures | None] = [self._defer(image) for image in loaded.images] if self.defer_images \
            else [None] * len(loaded.images)
        found += [None] * (len(hashes) - len(found))
        found = [f if f is not None else self.preprocess_cache.get(h) for f, h in zip(found, hashes)]
        missing = [i for i, f in enumerate(found) if f is None]
        ids: list[int] | None = None
        if missing:
            subset = loaded if len(missing) == len(found) else loaded.subset(missing)
            text = prompt if subset is loaded else None
            hf_output = self.call_hf_processor(text, subset)
            if text is not None:
                ids = [int(t) for t in hf_output["input_ids"][0].tolist()]
            counts = loaded.raw_counts()
            order = [m for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO) for _ in range(counts[m])]
            for i, f in zip(missing, self.split_hf_output(hf_output, subset), strict=True):
                assert f.modality is order[i], "split_hf_output must keep images, videos, audios order"
                self.preprocess_cache.put(hashes[i], f)
                found[i] = f
        if ids is None:
            ids = self.tokenize(prompt) if prompt is not None else list(input_ids or [])
        features = [f for f in found if f is not None]
        assert len(features) == len(hashes)
        return ids, features, hashes

    def _defer(self, image: Any) -> ItemFeatures | None:
        """A deferred image's features (pixels + plan), or None to process it eagerly."""
        plan = self.plan_image(image.height, image.width)
        if plan is None:
            return None
        return defer_image(image, plan, dict(self.mm_process_config.get(Modality.IMAGE, {})),
                           self.defer_min_feature_bytes)

    def preprocess_cache_stats(self) -> PreprocessCacheStats:
        return self.preprocess_cache.stats()

    @property
    def preprocess_cache_hits(self) -> int:
        return self.preprocess_cache.hits

    @property
    def preprocess_cache_misses(self) -> int:
        return self.preprocess_cache.misses

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        return build_items(input_ids, features, hashes, self.special_tokens)
