"""eval_vl's two sources of answers: tessera.Engine in float32 gives HF's answers on held-out scenes (so a
format only the Engine runs, e.g. a bf16 model's bf16 products, is scored on the same footing)."""

from __future__ import annotations

from demo import eval_vl

DEMO_VL = "tessera/assets/demo-vl"


def test_engine_answers_are_hf_answers_in_float32() -> None:
    samples = eval_vl.held_out(6, 2, 2)  # images, videos, copy prompts
    ours = eval_vl.engine_answers(DEMO_VL, samples, dtype="float32")
    assert ours == eval_vl.hf_answers(DEMO_VL, samples)
    assert len(set(ours)) > 3, ours  # different answers to different questions: not a degenerate run
    assert sum(eval_vl.accuracy(samples, ours).values()) >= 4  # a trained model answers most of them right
