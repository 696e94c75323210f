"""The server-footprint sampler: a process tree's RSS from /proc, found by the port it listens on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from tessera.bench.rss import RssSampler, listening_pid, process_tree, server_pid
from tessera.bench.serving import ServingConfig, run_benchmark_async

CHILD_MIB = 96


def test_the_tree_sum_counts_a_child_and_its_peak_outlives_it() -> None:
    code = f"import sys, time; b = bytearray({CHILD_MIB} << 20); print(flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the buffer is allocated (and touched: bytearray zero-fills)
        assert child.pid in process_tree(os.getpid())
        sampler = RssSampler(os.getpid(), interval_s=0.01).start()
        own = sampler.peak_by_pid[os.getpid()]
    finally:
        child.stdin.close()
        child.wait()
    report = sampler.stop()
    by_pid = {p["pid"]: p for p in report["processes"]}
    assert by_pid[child.pid]["peak_rss_mib"] >= CHILD_MIB and by_pid[child.pid]["hwm_mib"] >= CHILD_MIB
    assert report["peak_rss_mib"] * 2**20 >= own + (CHILD_MIB << 20)
    assert child.pid not in process_tree(os.getpid())


def test_the_serving_benchmark_reports_the_listening_process(fake_server) -> None:
    # The fake server runs in a thread of this process, so this process is the server.
    assert server_pid(fake_server.base_url) == os.getpid()
    assert server_pid("http://example.com:80") is None and listening_pid(9) is None
    cfg = ServingConfig(base_url=fake_server.base_url, dataset="scenes", num_prompts=2, output_len=2,
                        disable_tqdm=True, num_warmup=0)
    memory = asyncio.run(run_benchmark_async(cfg))["server_memory"]
    assert memory["pid"] == os.getpid() and memory["peak_rss_mib"] > 10
    off = ServingConfig(base_url=fake_server.base_url, dataset="scenes", num_prompts=1, output_len=1,
                        disable_tqdm=True, num_warmup=0, server_pid=0)
    assert asyncio.run(run_benchmark_async(off))["server_memory"] is None


def test_pss_at_the_end_counts_pages_two_processes_share_once() -> None:
    """A child forked after touching a buffer shares its pages with the parent: the tree's RSS counts them
    twice, its PSS once."""
    import mmap

    shared = mmap.mmap(-1, CHILD_MIB << 20)  # a shared anonymous map: both processes keep the same pages
    shared.write(b"\1" * (CHILD_MIB << 20))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child touches every page (reads), says so, and waits for the parent's word
        try:
            sum(shared[i] for i in range(0, CHILD_MIB << 20, 4096))
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        sampler = RssSampler(os.getpid(), interval_s=0.05).start()
        report = sampler.stop()
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
    assert report["end_rss_mib"] - report["end_pss_mib"] >= 0.9 * CHILD_MIB
    assert report["end_pss_mib"] > 0
