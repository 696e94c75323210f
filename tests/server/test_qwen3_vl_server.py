"""Qwen3-VL served end to end: the OpenAI API on a tiny random checkpoint (DeepStack, interleaved M-RoPE,
timestamped video frame groups) answers exactly as HF generate: one image, two images of other shapes, the
first image again (a prefix-cache hit), and a video. Prefill chunks of 16 tokens split every image and video
across chunks, so the worker's per-chunk embedding rows (and their DeepStack levels) are exercised."""

from __future__ import annotations

import pytest

from tests.models.qwen3_vl_testing import make_tiny_qwen3_vl_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_images_and_video_match_hf, check_model_info

MAX_TOKENS = 8
NUM_FRAMES = 4


@pytest.fixture(scope="module")
def qwen3_vl_server(tmp_path_factory):
    path = make_tiny_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
                        "--page-size", "4", "--mm-process-config", f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}')
    yield srv, path
    srv.stop()


def test_chat_matches_hf(qwen3_vl_server) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    srv, path = qwen3_vl_server
    model = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    check_images_and_video_match_hf(srv.base_url, path, model, NUM_FRAMES, MAX_TOKENS, fps=5, min_cached=20)


def test_model_info(qwen3_vl_server) -> None:
    srv, _ = qwen3_vl_server
    check_model_info(srv.base_url, "Qwen3VLForConditionalGeneration", video=True)
