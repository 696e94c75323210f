"""The offline Engine API: batches, streaming, async, n, stops, logprobs, and bad input."""

from __future__ import annotations

import asyncio

import pytest

from tessera import Engine


@pytest.fixture(scope="module")
def engine(tiny_gqa):
    eng = Engine(str(tiny_gqa), max_total_tokens=2048, chunked_prefill_size=64, max_running_requests=8,
                 show_progress=False)
    yield eng
    eng.shutdown()


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_single_and_batch(engine):
    assert engine.server_args.disable_tqdm and not engine.show_progress  # show_progress=False: no bar anywhere
    one = engine.generate("Hello there", GREEDY)
    assert isinstance(one, dict) and len(one["output_ids"]) == 6
    assert one["meta_info"]["completion_tokens"] == 6
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert one["text"] == engine.tokenizer.decode(one["output_ids"])
    batch = engine.generate(["Hello there", "What color is the circle?"], GREEDY)
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    ids = engine.tokenizer.encode("Hello there")
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == one["output_ids"]


def test_stream_matches_non_stream(engine):
    full = engine.generate("Tell me", GREEDY)
    chunks = list(engine.generate("Tell me", GREEDY, stream=True))
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert "".join(c["delta"] for c in chunks) == full["text"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # sent text never changes


def test_async_generate_and_stream(engine):
    async def main():
        a = await engine.async_generate("Hello there", GREEDY)
        pieces = [c async for c in await engine.async_generate("Hello there", GREEDY, stream=True)]
        many = await asyncio.gather(*(engine.async_generate(f"prompt {i}", GREEDY) for i in range(5)))
        return a, pieces, many

    a, pieces, many = asyncio.run(main())
    assert pieces[-1]["output_ids"] == a["output_ids"]
    assert len(many) == 5 and all(len(m["output_ids"]) == 6 for m in many)


def test_n_samples_and_seeds(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 8, "n": 3, "seed": 7, "ignore_eos": True}
    outs = engine.generate("Once upon a time", sp)
    assert len(outs) == 3
    again = engine.generate("Once upon a time", sp)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # different seeds per sample


def test_stop_token_and_string(engine):
    base = engine.generate("Hello there", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    ids = base["output_ids"]
    cut = engine.generate("Hello there", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True,
                                          "stop_token_ids": [ids[2]]})
    first = ids.index(ids[2])
    assert cut["output_ids"] == ids[: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        s = engine.generate("Hello there", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True,
                                            "stop": stop})
        assert s["text"] == text[: text.find(stop)]
        assert s["meta_info"]["finish_reason"]["type"] == "stop"


def test_streamed_stop_string_is_cut_and_never_sent(engine):
    """The scheduler matches the stop string; the stream holds back its beginning and ends before it."""
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    base = engine.generate("Hello there", sp)
    text, ids = base["text"], base["output_ids"]
    # A stop string across a token boundary: its first character is streamable before the second arrives.
    ends = [len(engine.tokenizer.decode(ids[: j + 1])) for j in range(len(ids) // 3, len(ids) - 1)]
    k = next(e - 1 for e in ends if 0 < e < len(text) and not any(c.isspace() for c in text[e - 1 : e + 1])
             and text.find(text[e - 1 : e + 1]) == e - 1)
    stop = text[k : k + 2]
    chunks = list(engine.generate("Hello there", {**sp, "stop": [stop]}, stream=True))
    assert "".join(c["delta"] for c in chunks) == chunks[-1]["text"] == text[:k]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate("Hello there", {**sp, "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == text[: k + 2]


def test_logprobs(engine):
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True,
                                    "top_logprobs_num": 3}, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == out["output_ids"]
    for (lp, tok), top in zip(lps, out["meta_info"]["output_top_logprobs"]):
        # SGLang's order, as in output_token_logprobs: (logprob, token id); the greedy token is the top-1
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)
        assert [v for v, _ in top] == sorted([v for v, _ in top], reverse=True)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi " * 5000), "context length"),
    (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
    (dict(prompt="hi", sampling_params={"top_p": 0}), "top_p"),
    (dict(prompt="hi", sampling_params={"max_new_tokens": 10**6}), "max_new_tokens"),
    (dict(prompt="hi", sampling_params={"bogus": 1}), "bogus"),
    (dict(input_ids=[10**9]), "input_ids"),
    (dict(prompt="hi", input_ids=[1]), "prompt"),
])
def test_bad_input_is_a_clear_value_error_and_engine_keeps_serving(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(**kwargs)
    assert len(engine.generate("still alive", GREEDY)["output_ids"]) == 6
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.kv_used_tokens == 0


def test_no_kv_leak_after_many_requests(engine):
    engine.generate([f"request number {i}" for i in range(20)],
                    [{"temperature": 0.5, "max_new_tokens": 3 + i % 5, "seed": i} for i in range(20)])
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_used_tokens == 0


def test_retraction_under_memory_pressure_gives_identical_outputs(tiny_gqa, engine):
    prompts = [f"Request {i}: please write a long answer about shapes and colors" for i in range(6)]
    sp = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = [o["output_ids"] for o in engine.generate(prompts, sp)]
    with Engine(str(tiny_gqa), max_total_tokens=192, page_size=4, chunked_prefill_size=32,
                max_running_requests=6, show_progress=False) as small:
        outs = small.generate(prompts, sp)
        stats = small.get_stats()
    assert stats.num_retractions > 0, "the pool was meant to be too small for all requests at once"
    assert [o["output_ids"] for o in outs] == expected


def test_pending_requests_fail_when_the_scheduler_dies(tiny_gqa):
    import time

    with Engine(str(tiny_gqa), max_total_tokens=8192, show_progress=False) as eng:
        stream = eng.generate("Hello", {"max_new_tokens": 4000, "ignore_eos": True}, stream=True)
        next(stream)
        eng.tokenizer_manager._procs[0].kill()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="scheduler process exited"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 10


def test_server_info_reports_the_device_time_between_steps(engine):
    """get_server_info()["stats"]: how long the device ran steps and sat idle between consecutive ones (on a CPU,
    wall time), and the idle share, which an overlap of host and device work would win back."""
    before = engine.get_server_info()["stats"]
    engine.generate("Count to ten:", {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    stats = engine.get_server_info()["stats"]
    assert stats["device_busy_s"] > before["device_busy_s"]
    assert stats["device_idle_s"] > before["device_idle_s"]  # eleven decode steps follow one another
    assert 0 < stats["device_idle_fraction"] < 1
    assert stats["device_idle_fraction"] == round(stats["device_idle_s"] / (stats["device_idle_s"]
                                                                           + stats["device_busy_s"]), 4)
