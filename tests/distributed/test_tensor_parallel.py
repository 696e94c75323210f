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
from tests.models.quant_fixtures import Scheme, quantize_checkpoint

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
    ids1, lp1, info1 = _run(model_path, 1, prompts, **media)
    ids2, lp2, info = _run(model_path, 2, prompts, **media)
    assert info["effective"]["tp_size"] == 2
    # The whole model's parameters, not rank 0's shard times the ranks (replicated norms and towers once).
    assert info["effective"]["num_parameters"] == info1["effective"]["num_parameters"]
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


def test_pre_quantized_awq_checkpoint(tmp_path, scene_images, monkeypatch) -> None:
    """Each rank takes its rows / columns of the quantized weights (group boundaries: 32 of 64 and 128). In
    float32 products: bf16 ones (a CPU with AVX512-BF16) round each rank's partial sums to bf16 before they are
    added, which moves this random model's near-tied choices; the sharding is what is checked here."""
    monkeypatch.setenv("TESSERA_BF16_COMPUTE", "0")
    src = make_tiny_checkpoint(tmp_path / "float", num_kv_heads=2)
    quantize_checkpoint(src, tmp_path / "awq", tmp_path / "reference", Scheme("awq"), ["visual", "lm_head"])
    path = str(tmp_path / "awq")
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


def test_dp_encoder_assignment_balances_skewed_sizes() -> None:
    from tessera.distributed.encoder_dp import dp_encoder_assignment

    sizes = [4096, 64, 64, 1024, 256, 2304, 64, 576, 1600, 144]  # patch counts of 224..1536 px images
    shares = dp_encoder_assignment(sizes, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in s) for s in shares]
    assert max(loads) / (sum(loads) / 2) < 1.05  # 5188 vs 5064
    assert dp_encoder_assignment(sizes, 2) == shares  # every rank computes the same
    assert dp_encoder_assignment([5, 5, 5], 4) == [[0], [1], [2], []]  # fewer items than ranks
    one = dp_encoder_assignment([100, 1, 1, 1], 2)
    assert one[0] == [0] and one[1] == [1, 2, 3]  # a dominant item gets a rank to itself


def test_dp_encoder_matches_one_rank(scene_images) -> None:
    """Four images of different sizes in one step, shared over 2 ranks: the same tokens as tp 1."""
    path = str(ASSETS_DIR / "demo-vl")
    images = [im.resize((w, h)) for im, (w, h) in zip(scene_images, [(112, 112), (224, 168), (56, 84), (168, 168)])]
    prompts = [_chat(path, [{"type": "image"}, {"type": "text", "text": q}])
               for q in ("Describe the image.", "How many shapes are there?", "Describe the image.",
                         "What color is the circle?")]
    ids1, lp1, _ = _run(path, 1, prompts, image_data=images)
    with Engine(path, tp_size=2, mm_enable_dp_encoder=True, max_total_tokens=4096, show_progress=False) as e:
        outs = e.generate(prompts, SAMPLING, image_data=images, return_logprob=True)
        stats = e.get_stats()
    assert [o["output_ids"] for o in outs] == ids1
    for o, ref in zip(outs, lp1):
        assert max(abs(lp - r) for (lp, _), r in zip(o["meta_info"]["output_token_logprobs"], ref)) < 1e-5
    assert stats.encoder_cache_misses == 4


def _dp_encode_rank(rank: int, init_method: str, result_path: str) -> None:
    import torch

    from tessera.distributed.encoder_dp import dp_sharded_encode
    from tessera.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(rank, 2, init_method, torch.device("cpu"))
    torch.manual_seed(0)
    proj = torch.nn.Linear(6, 5)
    items = [torch.randn(n, 6) for n in (9, 2, 4, 7, 1)]
    calls: list[int] = []

    def encoder(batch):
        calls.append(len(batch))
        return [proj(x) for x in batch]

    with torch.no_grad():
        got = dp_sharded_encode(encoder, items, [x.shape[0] for x in items], torch.float32, torch.device("cpu"))
        want = [proj(x) for x in items]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    torch.save({"rank": rank, "calls": calls}, f"{result_path}.{rank}")
    destroy_tensor_parallel()


def test_dp_sharded_encode_equals_the_unsharded_encoder(tmp_path) -> None:
    import torch
    import torch.multiprocessing as mp

    from tessera.distributed.tp_launch import free_init_method

    mp.spawn(_dp_encode_rank, args=(free_init_method(), str(tmp_path / "r")), nprocs=2, join=True)
    calls = [torch.load(tmp_path / f"r.{r}")["calls"] for r in range(2)]
    assert calls == [[3], [2]]  # largest first to the least loaded: rank 0 gets 9 + 2 + 1, rank 1 gets 7 + 4


def test_dp_encoder_balance_report() -> None:
    from tessera.bench.dp_encoder import markdown, merged_patches, run

    assert merged_patches(448, 448) == 256 and merged_patches(224, 1536) == 8 * 55
    rows = run(steps=20, images_per_step=(16,), ranks=(2, 4))
    for row in rows:  # greedy never does worse than the contiguous split, and is near 1 at 16 images
        assert 1.0 <= row["greedy_median"] <= row["contiguous_median"]
        assert row["greedy_median"] < 1.1
    assert markdown(rows).count("\n| 16 |") == 2


def test_settings_never_travel_in_argv_and_a_dead_tp_rank_fails_requests_clearly() -> None:
    """One tp-2 engine for both (one start instead of two). `ps` must not show the API key: scheduler and TP ranks
    get their settings over a pipe. Then the TP ranks are killed: a request fails with a clear error instead of
    hanging, and the replica stops itself."""
    import os
    import signal
    import time

    from tests.server.server_process import children_of

    with Engine(str(ASSETS_DIR / "demo-vl"), tp_size=2, api_key="sekret-4711", max_total_tokens=2048,
                show_progress=False) as engine:
        scheduler = engine.tokenizer_manager._procs[0]
        ranks = children_of(scheduler.pid)
        assert ranks, "the scheduler started no TP rank process"
        for pid in [scheduler.pid, *ranks]:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"sekret-4711" not in f.read()
        assert engine.generate("Hi", SAMPLING)["meta_info"]["completion_tokens"] == MAX_NEW

        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited|rank"):
            engine.generate("Hello", SAMPLING)
        assert time.monotonic() - started < 60
        scheduler.wait(timeout=30)  # the replica stopped itself
