"""--tp-size 2 on CPU (gloo): the same greedy tokens as one rank, logprobs within 1e-5 (an all-reduce sums the
partial products in another order than one matmul, so the last bits may differ).

Each case runs the same requests through Engine(tp_size=1) and Engine(tp_size=2): images, a video, audio,
batched, with chunked prefill and a prefix-cache hit (the same image twice).
"""

from __future__ import annotations

import pytest

from tessera import Engine
from tessera.config import ASSETS_DIR
from tests.audio_testing import INSTRUCTION, build_tiny_audio_checkpoint, speechlike, tone
from tests.engine.conftest import make_tiny_checkpoint
from tests.models.qwen2_5_vl_testing import make_tiny_qwen2_5_vl_checkpoint

MAX_NEW = 8
SAMPLING = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def _run(model_path: str, tp: int, prompts: list[str], **media) -> tuple[list[list[int]], list[list[float]], dict]:
    with Engine(model_path, tp_size=tp, max_total_tokens=4096, chunked_prefill_size=64, show_progress=False) as e:
        outs = e.generate(prompts, SAMPLING, return_logprob=True, **media)
        info = e.get_server_info()
    ids = [o["output_ids"] for o in outs]
    logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return ids, logprobs, info


def _compare(model_path: str, prompts: list[str], **media) -> None:
    ids1, lp1, _ = _run(model_path, 1, prompts, **media)
    ids2, lp2, info = _run(model_path, 2, prompts, **media)
    assert info["effective"]["tp_size"] == 2
    assert ids2 == ids1
    for a, b in zip(lp1, lp2):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert len({tuple(i) for i in ids1}) > 1  # the prompts really differ in their answers


def _chat(engine_or_path: str, content: list[dict]) -> str:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(engine_or_path)
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def test_demo_vl_images_and_video() -> None:
    path = str(ASSETS_DIR / "demo-vl")
    image = str(ASSETS_DIR / "examples" / "scene.png")
    video = str(ASSETS_DIR / "examples" / "moving.mp4")
    img_q = _chat(path, [{"type": "image"}, {"type": "text", "text": "Describe the image."}])
    count_q = _chat(path, [{"type": "image"}, {"type": "text", "text": "How many shapes are there?"}])
    vid_q = _chat(path, [{"type": "video"}, {"type": "text", "text": "Describe the video."}])
    text_q = _chat(path, [{"type": "text", "text": "Hello"}])
    _compare(path, [img_q, count_q, vid_q, text_q], image_data=[image, image, None, None],
             video_data=[None, None, video, None])


@pytest.mark.parametrize("kv_heads", [1, 4])  # 1: the KV head is replicated on both ranks; 4: split 2 + 2
def test_tiny_qwen2_vl_gqa_layouts(tmp_path, kv_heads: int, scene_images) -> None:
    path = str(make_tiny_checkpoint(tmp_path, num_kv_heads=kv_heads, seed=kv_heads))
    prompts = [_chat(path, [{"type": "image"}, {"type": "text", "text": t}]) for t in ("What?", "Where is it?")]
    _compare(path, prompts, image_data=scene_images[:2])


def test_tiny_qwen2_5_vl(tmp_path, scene_images) -> None:
    path = str(make_tiny_qwen2_5_vl_checkpoint(tmp_path))
    prompts = [_chat(path, [{"type": "image"}, {"type": "text", "text": t}]) for t in ("What?", "Count them.")]
    _compare(path, prompts, image_data=scene_images[1:3])


def test_tiny_qwen2_audio(tmp_path) -> None:
    path = str(build_tiny_audio_checkpoint(tmp_path, num_kv_heads=2))
    prompts = [_chat(path, [{"type": "audio"}, {"type": "text", "text": INSTRUCTION}]),
               _chat(path, [{"type": "audio"}, {"type": "text", "text": "Hello."}])]
    _compare(path, prompts, audio_data=[tone(1.1), speechlike(2.2, seed=2)])
