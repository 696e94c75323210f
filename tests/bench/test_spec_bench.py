"""`tessera bench spec` on demo-vl's scene questions: ORACLE keys its recorded answers on the ids the scheduler
sees (image placeholders expanded), so its drafts are accepted, the outputs equal plain decoding's, and the
summary separates the first token (which speculation cannot shorten) from the time after it."""

from __future__ import annotations

from tessera.bench.speculative import SpecBenchConfig, format_summary, run_spec_bench


def test_oracle_on_scene_questions() -> None:
    cfg = SpecBenchConfig(model_path="demo-vl", algorithm="ORACLE", dataset="scenes", num_prompts=3,
                          output_len=32, concurrency=(1,), num_runs=1)
    result = run_spec_bench(cfg)
    row = result["by_concurrency"]["1"]
    assert row["identical"] is True
    assert row["verify_steps"] > 0 and row["accept_length"] > 2.0 and row["accept_rate"] > 0.5
    assert 0 < row["first_token_share"] < 1 and row["after_first_speedup"] > 0
    assert len(row["runs"]["first_token_s"]) == 1
    summary = format_summary(result)
    assert "after 1st" in summary and "scenes, 3 prompts" in summary
