"""The frontend's preprocessing threads run torch ops on one intra-op thread, without changing anyone else's."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tessera.platform.threads import one_torch_thread


def _count_in_new_thread() -> int:
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_preprocessing_thread_uses_one_torch_thread_and_leaves_the_rest():
    mine = torch.get_num_threads()
    inherited = mine + 1  # distinguishable from both 1 and this thread's own count
    try:
        with ThreadPoolExecutor(max_workers=2, initializer=one_torch_thread, initargs=(inherited,)) as pool:
            counts = list(pool.map(lambda _: torch.get_num_threads(), range(8)))
        assert set(counts) == {1}
        assert torch.get_num_threads() == mine  # the calling thread keeps its own count
        assert _count_in_new_thread() == inherited  # threads started later begin with the inherited count
    finally:
        restore = threading.Thread(target=torch.set_num_threads, args=(mine,))
        restore.start()
        restore.join()
