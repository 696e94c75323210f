"""The frontend's preprocessing threads (tokenization, media decoding and the HF processor, off the event loop)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tessera.platform.threads import one_torch_thread


def preprocess_executor(max_workers: int) -> ThreadPoolExecutor:
    """A pool whose threads run torch on one intra-op thread each (one_torch_thread); threads started
    elsewhere later keep the count this caller's thread has now."""
    import torch

    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tessera-pre",
                              initializer=one_torch_thread, initargs=(torch.get_num_threads(),))
