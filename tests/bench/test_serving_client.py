"""The serving benchmark client against a fake OpenAI server whose timings and limits are known."""

from __future__ import annotations

import asyncio
import json

import pytest

from tessera.bench.cli import run_bench
from tessera.bench.datasets import BenchRequest, poisson_intervals
from tessera.bench.serving import ServingConfig, run_benchmark_async
from tests.bench.conftest import FAKE_MODEL, ITL_S, TTFT_S


def _cfg(url: str, **kw) -> ServingConfig:
    kw.setdefault("disable_tqdm", True)
    kw.setdefault("num_warmup", 0)
    return ServingConfig(base_url=url, **kw)


def test_streams_are_timed_and_bounded_by_max_concurrency(fake_server) -> None:
    cfg = _cfg(fake_server.base_url, dataset="random-image", image_resolution="32x32", num_prompts=6,
               output_len=5, max_concurrency=2)
    result = asyncio.run(run_benchmark_async(cfg))
    m = result["metrics"]
    assert result["model"] == FAKE_MODEL  # no --model: the first one /v1/models lists
    assert (m["num_completed"], m["num_failed"]) == (6, 0)
    assert (m["total_output_tokens"], m["total_input_tokens"]) == (30, 42)  # from the streamed usage
    assert fake_server.state.max_in_flight == 2
    assert m["ttft_ms"]["median"] >= TTFT_S * 1000 * 0.9
    assert m["itl_ms"]["count"] == 6 * 4
    assert ITL_S * 1000 * 0.8 <= m["itl_ms"]["median"] < ITL_S * 1000 * 10
    # Six requests of (TTFT + 4 ITL), two at a time: at least three rounds.
    assert m["duration_s"] >= 3 * (TTFT_S + 4 * ITL_S) * 0.9
    body = fake_server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["min_tokens"]) == (5, True, 5)
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_poisson_arrivals_spread_the_run(fake_server) -> None:
    cfg = _cfg(fake_server.base_url, dataset="scenes", num_prompts=5, output_len=1, request_rate=25.0, seed=4)
    result = asyncio.run(run_benchmark_async(cfg))
    # The last request cannot start before the sum of the gaps before it.
    assert result["metrics"]["duration_s"] >= sum(poisson_intervals(5, 25.0, 4)[:-1])


def test_failures_are_counted_with_their_message_and_ignore_eos_can_be_dropped(fake_server) -> None:
    reqs = [BenchRequest("ok", (), "image/png", (), 2), BenchRequest("FAIL please", (), "image/png", (), 2)]
    cfg = _cfg(fake_server.base_url, model=FAKE_MODEL, ignore_eos=False)
    result = asyncio.run(run_benchmark_async(cfg, reqs))
    m = result["metrics"]
    assert (m["num_completed"], m["num_failed"]) == (1, 1)
    (msg,) = m["errors"]
    assert "BadRequestError" in msg and "400" in msg
    assert all("ignore_eos" not in b and "min_tokens" not in b for b in fake_server.state.bodies)


def test_cli_writes_json_and_plots_several_results(fake_server, tmp_path) -> None:
    paths = []
    for conc in (1, 3):
        path = tmp_path / f"c{conc}.json"
        code = run_bench(["serving", "--base-url", fake_server.base_url + "/v1", "--dataset", "random-image",
                          "--image-resolution", "24x24", "--num-prompts", "3", "--output-len", "2",
                          "--max-concurrency", str(conc), "--disable-tqdm", "--output-json", str(path)])
        assert code == 0
        saved = json.loads(path.read_text())
        assert saved["metrics"]["num_completed"] == 3 and "api_key" not in saved["config"]
        paths.append(str(path))
    png = tmp_path / "latency.png"
    assert run_bench(["serving", "--plot", str(png), "--from-json", *paths]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_fails_the_warmup_with_a_clear_error() -> None:
    cfg = ServingConfig(base_url="http://127.0.0.1:9", model="m", num_prompts=1, disable_tqdm=True, timeout_s=5)
    with pytest.raises(ValueError, match="warm-up request failed"):
        asyncio.run(run_benchmark_async(cfg))


def test_no_server_and_no_model_is_a_clear_error() -> None:
    cfg = ServingConfig(base_url="http://127.0.0.1:9", num_prompts=1, disable_tqdm=True, timeout_s=5)
    with pytest.raises(ValueError, match="base_url: cannot list the models"):
        asyncio.run(run_benchmark_async(cfg))
