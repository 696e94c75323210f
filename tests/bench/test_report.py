"""The results tables render from result dicts and land between the doc's markers, nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.bench.metrics import RequestResult, compute_metrics
from tessera.bench.offline import summarize
from tessera.bench.report import DEFAULT_DOC, END_MARKER, START_MARKER, load_dir, render, update_doc

PER_SYSTEM = {
    "tessera": {"a": {"tok_s": 300.0}, "b": {"tok_s": 400.0, "ttft_first_seen_ms": 50.0, "ttft_repeat_ms": 10.0},
                "c": {"tok_s": 200.0, "prefill_tokens": 1000}, "d": {"bs1": 5.0, "bs32": 9.0}},
    "tessera_nocache": {"b": {"tok_s": 200.0, "ttft_first_seen_ms": 50.0, "ttft_repeat_ms": 45.0},
                        "c": {"tok_s": 100.0, "prefill_tokens": 4000}},
    "hf": {"a": {"tok_s": 100.0}, "b": {"tok_s": 100.0}, "c": {"tok_s": 50.0}, "d": {"bs1": 10.0, "bs32": 30.0}},
}


def _offline_result() -> dict:
    return {"model_path": "demo-vl", "date": "2026-11-29 12:00:00", "config": {"num_runs": 3, "num_requests": 64},
            "machine": {"cpu": "Test CPU", "cpu_count": 2, "torch_threads": 2, "python": "3.11", "torch": "2"},
            "results": summarize(PER_SYSTEM, ("a", "b", "c", "d"))}


def test_summarize_derives_ratios() -> None:
    r = summarize(PER_SYSTEM, ("a", "b", "c", "d"))
    assert r["a"]["ratio_vs_hf"] == pytest.approx(3.0)
    assert r["b"]["cache_speedup"] == pytest.approx(2.0)
    assert r["c"]["prefill_reduction_pct"] == pytest.approx(75.0)
    assert r["d"]["speedup_bs1"] == pytest.approx(2.0)


def test_render_contains_every_figure() -> None:
    serving = {"model": "demo-vl", "config": {"dataset": "scenes", "num_prompts": 4, "output_len": 2,
                                              "max_concurrency": 4},
               "metrics": compute_metrics([RequestResult(True, 5, 2, 0.1, 0.3, [0.2])], 1.0).to_dict()}
    text = render([_offline_result()], [serving, serving])
    for figure in ("300.0 / 100.0", "3.00x", "400.0 / 200.0", "2.00x", "50.0 / 10.0", "1000 / 4000", "75.0%",
                   "5.00 / 10.00", "9.00 / 30.00 (32)", "Test CPU", "median of 3 run(s)", "a: 64 image requests"):
        assert figure in text, figure
    assert "| 4 | 2 | 1.00 | 2.0 | 100.0 / 100.0 | 200.0 | 300.0 | 0 |" in text


def test_load_dir_reads_only_the_reports_own_files(tmp_path: Path) -> None:
    import json

    serving = {"model": "demo-vl", "config": {"dataset": "scenes"}, "metrics": {"num_completed": 1}}
    (tmp_path / "offline-demo-vl.json").write_text(json.dumps(_offline_result()))
    (tmp_path / "serving-demo-vl-c4-run0.json").write_text(json.dumps(serving))
    # A hand-run serving check and a profile kept in the same directory stay out of the tables.
    (tmp_path / "random-image-c16.json").write_text(json.dumps({**serving, "config": {"dataset": "random-image"}}))
    (tmp_path / "profile-demo-vl.json").write_text(json.dumps({"results": {}, "machine": {}}))
    offline, served = load_dir(tmp_path)
    assert [d["model_path"] for d in offline] == ["demo-vl"]
    assert [d["config"]["dataset"] for d in served] == ["scenes"]


def test_update_doc_replaces_only_between_markers(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(f"intro\n{START_MARKER}\nold table\n{END_MARKER}\noutro\n")
    update_doc(doc, "new table")
    assert doc.read_text() == f"intro\n{START_MARKER}\nnew table\n{END_MARKER}\noutro\n"
    update_doc(doc, "newer")
    assert doc.read_text().count("newer") == 1 and "new table" not in doc.read_text()
    (tmp_path / "bad.md").write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_doc(tmp_path / "bad.md", "x")


def test_the_real_doc_has_the_markers() -> None:
    text = DEFAULT_DOC.read_text()
    assert text.index(START_MARKER) < text.index(END_MARKER)
    assert render([], []) == "_Not yet measured._"
