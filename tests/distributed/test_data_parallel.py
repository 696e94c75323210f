"""--dp-size 2: two scheduler + worker replicas behind one frontend answer exactly as one replica does."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tessera import Engine
from tessera.config import ASSETS_DIR
from tests.server.server_process import ServerProcess

IMAGE = str(ASSETS_DIR / "examples" / "scene.png")
VIDEO = str(ASSETS_DIR / "examples" / "moving.mp4")
QUESTIONS = ["Describe the image.", "How many shapes are there?", "What color is the circle?",
             "What shape is the blue object?"]
SAMPLING = {"temperature": 0, "max_new_tokens": 12}


def _requests(engine: Engine) -> tuple[list[str], list, list]:
    prompts, images, videos = [], [], []
    for q in QUESTIONS:
        prompts.append(engine.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": q}]}]))
        images.append(IMAGE)
        videos.append(None)
    prompts.append(engine.apply_chat_template([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "Describe the video."}]}]))
    images.append(None)
    videos.append(VIDEO)
    return prompts * 2, images * 2, videos * 2


@pytest.fixture(scope="module")
def reference() -> list[str]:
    with Engine("demo-vl", max_total_tokens=4096, show_progress=False) as engine:
        prompts, images, videos = _requests(engine)
        return [o["text"] for o in engine.generate(prompts, SAMPLING, image_data=images, video_data=videos)]


@pytest.fixture(scope="module")
def dp2_round_robin():
    """One dp-2 engine (round robin) for the two tests that need one: the second kills a replica of it."""
    with Engine("demo-vl", dp_size=2, load_balance_method="round_robin", max_total_tokens=4096,
                show_progress=False) as engine:
        yield engine


def check_dp2_matches_dp1(engine: Engine, reference: list[str]) -> None:
    prompts, images, videos = _requests(engine)
    outs = engine.generate(prompts, SAMPLING, image_data=images, video_data=videos)
    assert [o["text"] for o in outs] == reference
    total = engine.get_stats()
    per_replica = engine.tokenizer_manager.replica_stats
    assert total.num_forward_steps == sum(r.num_forward_steps for r in per_replica)
    assert [r.dp_rank for r in per_replica] == [0, 1]
    assert all(r.num_forward_steps > 0 for r in per_replica)  # both replicas served
    info = engine.get_server_info()
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1] and info["stats"]["dp_rank"] == -1


def test_engine_dp2_round_robin_matches_dp1(reference, dp2_round_robin) -> None:
    check_dp2_matches_dp1(dp2_round_robin, reference)


def test_engine_dp2_cache_aware_matches_dp1(reference) -> None:
    with Engine("demo-vl", dp_size=2, load_balance_method="cache_aware", max_total_tokens=4096,
                show_progress=False) as engine:
        check_dp2_matches_dp1(engine, reference)


def test_a_dead_replica_is_taken_out_and_the_other_serves(reference, dp2_round_robin) -> None:
    """Runs after the round-robin test in this file (pytest keeps file order) and ends its engine's replica 1."""
    engine = dp2_round_robin
    engine.flush_cache()  # the survivor recomputes everything, as on a fresh engine
    prompts, images, videos = _requests(engine)
    os.kill(engine.tokenizer_manager._procs[1].pid, signal.SIGKILL)
    time.sleep(0.5)
    outs = engine.generate(prompts, SAMPLING, image_data=images, video_data=videos)
    assert [o["text"] for o in outs] == reference
    info = engine.get_server_info()
    assert [r["alive"] for r in info["replicas"]] == [True, False]


def test_server_dp2_answers_concurrent_requests_as_dp1(reference) -> None:
    import base64

    image = "data:image/png;base64," + base64.b64encode(open(IMAGE, "rb").read()).decode()
    srv = ServerProcess("--model-path", "demo-vl", "--dp-size", "2", "--load-balance-method", "shortest_queue",
                        "--max-total-tokens", "4096")
    try:
        def ask(question: str) -> str:
            body = {"model": "demo-vl", "temperature": 0, "max_tokens": SAMPLING["max_new_tokens"],
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                              {"type": "text", "text": question}]}]}
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, QUESTIONS * 2))
        assert answers == reference[:4] * 2
        info = httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()
        assert len(info["replicas"]) == 2 and info["dp_size"] == 2
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
        assert 'tessera_replica_num_running_reqs{dp_rank="1",model_name="demo-vl"}' in metrics
    finally:
        srv.stop()
