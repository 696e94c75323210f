"""Offline benchmark plumbing: prompts, the 512-token system prompt, bench-medium's size and build."""

from __future__ import annotations

import json

import pytest

from tessera.bench import medium
from tessera.bench.agreement import GreedyOutput, agreement, format_agreement
from tessera.bench.offline import OfflineConfig, build_workloads, decode_workloads
from tessera.config import ASSETS_DIR


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ASSETS_DIR / "demo-vl")


def test_workload_prompts_match_their_images_and_system_prompt_is_exact(processor) -> None:
    cfg = OfflineConfig(num_requests=4, max_output_len=6, system_prompt_len=512)
    works = build_workloads(cfg, processor)
    assert set(works) == {"a", "b", "c"}
    for w in works.values():
        for prompt, req in zip(w.prompts, w.requests):
            assert prompt.count("<|image_pad|>") == len(req.images) == 1
            assert req.output_len <= 6
    system = works["c"].requests[0].system
    assert len(processor.tokenizer.encode(system, add_special_tokens=False)) == 512
    assert all(p.startswith("<|im_start|>system\n" + system) for p in works["c"].prompts)
    decode = decode_workloads(works["a"], OfflineConfig(num_requests=4, decode_len=10))
    assert [len(w.requests) for w in decode.values()] == [1, 4]
    assert all(r.output_len == 10 for w in decode.values() for r in w.requests)


def test_bad_offline_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="workload"):
        OfflineConfig(workloads=("a", "z"))
    with pytest.raises(ValueError, match="decode_len"):
        OfflineConfig(decode_len=1)
    with pytest.raises(ValueError, match="dtype"):
        OfflineConfig(dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        OfflineConfig(dtype="bfloat16", engine_args={"dtype": "float32"})


def test_dtype_reaches_both_sides() -> None:
    cfg = OfflineConfig(dtype="bfloat16", engine_args={"max_running_requests": 8})
    assert cfg.run_dtype == "bfloat16" and cfg.tessera_args == {"max_running_requests": 8, "dtype": "bfloat16"}
    assert OfflineConfig(engine_args={"dtype": "float32"}).run_dtype == "float32"  # the older way still works
    assert OfflineConfig().tessera_args == {"dtype": "auto"}


def test_agreement_counts_the_prefix_before_the_first_divergence() -> None:
    ours = [GreedyOutput([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), GreedyOutput([5, 6], [-1.0, -2.0]),
            GreedyOutput([7, 8], None)]
    ref = [GreedyOutput([1, 2, 9, 4], [-0.1, -0.25, -3.0, -0.4]), GreedyOutput([5, 6], [-1.0, -2.01]),
           GreedyOutput([7, 8], [-1.0, -1.0])]
    a = agreement(ours, ref)
    assert a["identical_requests"] == pytest.approx(2 / 3)
    assert a["prefix_tokens_fraction"] == pytest.approx((2 + 2 + 2) / 8)
    assert a["prefix_fraction_mean"] == pytest.approx((0.5 + 1 + 1) / 3)
    # Logprobs compare before the split only (position 2 scores different tokens), and only where both have them.
    assert a["logprobs_compared"] == 4 and a["max_logprob_diff"] == pytest.approx(0.05)
    assert "75.0% of tokens" in format_agreement(a)
    with pytest.raises(ValueError, match="agreement"):
        agreement(ours, ref[:2])


def test_bench_medium_is_about_150m_parameters(tmp_path) -> None:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    for name in medium.PROCESSOR_FILES:
        (tmp_path / name).write_bytes((ASSETS_DIR / "demo-vl" / name).read_bytes())
    cfg = medium.medium_config(tmp_path)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2VLForConditionalGeneration(cfg).parameters())
    assert 140e6 < n < 160e6
    demo = json.loads((ASSETS_DIR / "demo-vl" / "config.json").read_text())
    assert cfg.image_token_id == demo["image_token_id"] and cfg.text_config.vocab_size == demo["text_config"]["vocab_size"]


def test_build_is_deterministic_reused_and_loadable(tmp_path, monkeypatch) -> None:
    # Same code path as bench-medium, shrunk so the test writes kilobytes, not 600 MB.
    monkeypatch.setattr(medium, "TEXT_SIZES", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                                   num_attention_heads=1, num_key_value_heads=1))
    monkeypatch.setattr(medium, "VISION_SIZES", dict(depth=1, embed_dim=32, num_heads=1, hidden_size=64))
    a = medium.build_medium(seed=3, out_dir=tmp_path / "a")
    b = medium.build_medium(seed=3, out_dir=tmp_path / "b")
    assert medium.is_complete(a)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert medium.build_medium(seed=3, out_dir=a) == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-built leftovers
    # A build from older tokenizer/processor files than demo-vl's present ones is rebuilt in place.
    (a / "preprocessor_config.json").write_text("{}")
    assert not medium.is_current(a)
    assert medium.build_medium(seed=3, out_dir=a) == a and medium.is_current(a)
    assert (a / "preprocessor_config.json").read_bytes() == (ASSETS_DIR / "demo-vl" / "preprocessor_config.json").read_bytes()
    from tessera.config import ServerArgs

    assert ServerArgs(model_path=str(a)).model_path == str(a.resolve())
