"""`--mm-preprocess-workers N`: media loading and preprocessing in N worker processes.

The frontend's thread pool shares one GIL with the event loop: decoding, hashing and (eager) resizing of 16
requests' large images make health checks and token streaming wait for it. Here each worker process holds
its own copy of the multimodal processor (built from the same ServerArgs, so it decides deferral, counts
placeholders and hashes exactly as the frontend would) and returns the finished ProcessorOutput.

The preprocessing cache stays effective by routing: a request goes to the worker chosen by a digest of its
first media item, so a repeated image always meets the cache that saw it. Each worker gets 1/N of
--mm-cache-size-mb. Their counters come back with every result and are summed for the frontend's stats.

Results cross the process boundary as one pickle-5 blob with tensors as numpy (messages/codec.py), not
through torch's shared-memory file descriptors, which a busy server can run out of.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from typing import Any

import numpy as np

from tessera.config import ServerArgs
from tessera.multimodal.processors.loaded import as_list
from tessera.multimodal.processors.preprocess_cache import PreprocessCacheStats
from tessera import messages
from tessera.platform.launch import process_pool

__all__ = ["PreprocessPool", "route_digest"]

_SAMPLE = 1 << 16  # bytes read from each end of a media item to route it (decoding is what costs)
_processor: Any = None  # the worker process's multimodal processor


def _init_worker(args: ServerArgs) -> None:
    global _processor
    import torch

    from tessera.frontend.model_info import ModelInfo

    torch.set_num_threads(1)  # N workers side by side; a per-process thread pool would oversubscribe
    _processor = ModelInfo.load(args).make_mm_processor()


def _process(kwargs: dict[str, Any]) -> tuple[bytes, PreprocessCacheStats]:
    out = _processor.process(**kwargs)
    return messages.dumps(out), _processor.preprocess_cache_stats()


def _clear() -> PreprocessCacheStats:
    _processor.preprocess_cache.clear()
    return _processor.preprocess_cache_stats()


def _ready() -> PreprocessCacheStats:
    return _processor.preprocess_cache_stats()


def route_digest(*media: Any) -> bytes | None:
    """A digest of a request's first media item (its length and both ends), or None when it has none that
    can be read cheaply (preprocessed dicts)."""
    first = next((item for data in media for item in as_list(data)), None)
    if first is None or isinstance(first, dict):
        return None
    if isinstance(first, str):
        data: Any = first.encode()
    elif isinstance(first, (bytes, bytearray, memoryview)):
        data = bytes(first)
    elif hasattr(first, "tobytes") and hasattr(first, "size") and hasattr(first, "mode"):  # a PIL image
        data = np.asarray(first).tobytes()
    else:
        try:
            data = np.ascontiguousarray(np.asarray(first)).tobytes()
        except (TypeError, ValueError):
            return None
    h = hashlib.blake2b(digest_size=8)
    h.update(len(data).to_bytes(8, "little"))
    h.update(data[:_SAMPLE])
    h.update(data[-_SAMPLE:])
    return h.digest()


class PreprocessPool:
    def __init__(self, args: ServerArgs, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"mm_preprocess_workers: a pool needs at least one worker, got {workers}")
        child = args.replace(mm_cache_size_mb=args.mm_cache_size_mb // workers)
        self._workers = [process_pool(_init_worker, (child,)) for _ in range(workers)]
        self._stats = [PreprocessCacheStats(0, 0, 0, 0, child.mm_cache_size_mb * 1024 * 1024)] * workers
        self._next = itertools.cycle(range(workers))
        self._started = [w.submit(_ready) for w in self._workers]  # processes load while the model does

    def __len__(self) -> int:
        return len(self._workers)

    def wait_ready(self, timeout: float | None = None) -> None:
        for i, fut in enumerate(self._started):
            self._stats[i] = fut.result(timeout)

    def worker_for(self, digest: bytes | None) -> int:
        if digest is None:
            return next(self._next)
        return int.from_bytes(digest, "little") % len(self._workers)

    async def process(self, *, prompt: str | None, input_ids: list[int] | None, image_data: Any = None,
                      video_data: Any = None, audio_data: Any = None, video_kwargs: Any = None) -> Any:
        """The processor's `process(...)` on a worker; its exceptions (ValueError, MediaError) propagate."""
        i = self.worker_for(route_digest(image_data, video_data, audio_data))
        kwargs = dict(prompt=prompt, input_ids=input_ids, image_data=image_data, video_data=video_data,
                      audio_data=audio_data, video_kwargs=video_kwargs)
        blob, stats = await asyncio.wrap_future(self._workers[i].submit(_process, kwargs))
        self._stats[i] = stats
        return messages.loads(blob)

    async def clear_caches(self) -> None:
        futures = [asyncio.wrap_future(w.submit(_clear)) for w in self._workers]
        self._stats = list(await asyncio.gather(*futures))

    def cache_stats(self) -> PreprocessCacheStats:
        """The workers' preprocessing caches summed (as of each one's last result)."""
        s = self._stats
        return PreprocessCacheStats(sum(x.hits for x in s), sum(x.misses for x in s), sum(x.used_bytes for x in s),
                                    sum(x.num_entries for x in s), sum(x.capacity_bytes for x in s))

    def shutdown(self) -> None:
        for w in self._workers:
            w.shutdown(wait=False, cancel_futures=True)
