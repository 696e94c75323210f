"""GLM-4.1V served end to end: the OpenAI API on a tiny random checkpoint (GLM-4's sandwich norms and partial
pair-wise rotary, M-RoPE, a video as timestamped <|image|> frames) answers exactly as HF generate: one image, two
images of other shapes, the first image again (a prefix-cache hit), and a video. Prefill chunks of 16 tokens
split every image and video across chunks."""

from __future__ import annotations

import pytest

from tests.models.glm4v_testing import load_hf_reference, make_tiny_glm4v_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_images_and_video_match_hf, check_model_info

MAX_TOKENS = 8
NUM_FRAMES = 4


@pytest.fixture(scope="module")
def glm4v_server(tmp_path_factory):
    path = make_tiny_glm4v_checkpoint(tmp_path_factory.mktemp("glm4v"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
                        "--page-size", "4", "--mm-process-config", f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}')
    yield srv, path
    srv.stop()


def test_chat_matches_hf(glm4v_server) -> None:
    srv, path = glm4v_server
    check_images_and_video_match_hf(srv.base_url, path, load_hf_reference(path), NUM_FRAMES, MAX_TOKENS, fps=2,
                                    min_cached=16)


def test_model_info(glm4v_server) -> None:
    srv, _ = glm4v_server
    check_model_info(srv.base_url, "Glm4vForConditionalGeneration", video=True)
