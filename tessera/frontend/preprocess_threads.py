"""The frontend's preprocessing threads (tokenization, media decoding and the HF processor, off the event loop)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_THREADS_LOCK = threading.Lock()


def one_torch_thread(inherited: int) -> None:
    """Initializer of the preprocessing threads: their torch ops (image resize, normalize, patchify) run on one
    intra-op thread.

    Why: with torch's default (all cores) every op over an image's 150k values wakes an OpenMP team on the other
    cores, which then spin-wait for the next op, on the cores the scheduler process's model steps need (they
    also read as busy to its thread policy, platform/threads.py). demo-vl workload a on 2 cores, 3 runs each, three
    alternations: 3.37-3.57 s per run with this, 3.95-4.18 s without; the frontend's own CPU time was 0.68-0.69
    vs 0.67-0.74 s, so one thread costs it nothing at these sizes.

    torch.set_num_threads also sets the count that threads started afterwards begin with (threads already
    running keep theirs; MKL's count is per thread): a throwaway thread puts that back to `inherited`, so the
    application's own threads are not changed.
    """
    import torch

    with _THREADS_LOCK:
        torch.get_num_threads()  # runs torch's once-per-thread setup first, which would reset the count later
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(inherited,), name="tessera-threads")
        restore.start()
        restore.join()


def preprocess_executor(max_workers: int) -> ThreadPoolExecutor:
    """A pool whose threads run torch on one intra-op thread each (one_torch_thread); threads started
    elsewhere later keep the count this caller's thread has now."""
    import torch

    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tessera-pre",
                              initializer=one_torch_thread, initargs=(torch.get_num_threads(),))
