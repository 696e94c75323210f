"""Overlap scheduling (scheduler/overlap.py): the scheduler in process over demo-vl's real worker, the same
requests with the overlap on and off. Tokens and finish reasons are the same; logprobs agree to float rounding
(a request that finished rides one more step, and a batch's size can change a CPU product's summation order);
every KV slot comes back and the radix cache ends the same; an abort while its step is in flight keeps the
request's KV until that step is collected."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import zmq

from tessera.messages.finish import FinishKind, FinishReason
from tessera import messages
from tessera.config import ServerArgs
from tessera.messages.sampling import SamplingParams
from tessera.models.config import ModelConfig, eos_token_ids
from tessera.scheduler.scheduler import Scheduler
from tessera.worker.step_launch import resolve_placeholders
from tests.processed_chat import scene_question

_ports = itertools.count()
QUESTIONS = ["What color is the circle?", "Describe the scene.", "How many squares are there?", "Hello!",
             "What is left of the triangle?", "Count the shapes.", "Name a shape.", "Is there a red square?"]


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    from tessera.worker.model_worker import ModelWorker

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=4096, cpu_threads=1, max_running_requests=8,
                                 chunked_prefill_size=512)
    config = ModelConfig.load(args.model_path)
    eos = eos_token_ids(config)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False)) for q in QUESTIONS]
    return args, config, eos, ModelWorker(args, eos, config), prompts


def _run(demo, overlap: bool, arrivals: dict[int, list], on_step=None):
    """Drives a fresh scheduler over the shared worker until every request is answered; arrivals: loop
    iteration -> messages handled before it. Returns (rid -> ids, logprobs, top logprobs, finish), stats, sched."""
    args, config, eos, worker, _ = demo
    n = next(_ports)
    out = zmq.Context.instance().socket(zmq.PULL)
    out.bind(f"inproc://overlap-out-{n}")
    sched = Scheduler(args.replace(enable_overlap_schedule=overlap), f"inproc://overlap-in-{n}",
                      f"inproc://overlap-out-{n}", worker, config, eos)
    results: dict[str, dict] = {}
    arrivals = dict(arrivals)
    for i in itertools.count():
        for msg in arrivals.pop(i, []):
            sched.handle(msg)
        if sched.held:
            sched._admit_ready()
        progressed = sched.step()
        if on_step is not None:
            on_step(i, sched)
        while out.poll(0):
            for o in messages.recv(out).outputs:
                r = results.setdefault(o.rid, {"ids": [], "lp": [], "top": [], "finish": None})
                r["ids"] += o.new_token_ids
                r["lp"] += o.new_logprobs or []
                r["top"] += o.new_top_logprobs or []
                r["finish"] = o.finished_reason or r["finish"]
        if not (progressed or sched.reqs or arrivals or sched.held):
            break
        if not progressed:
            time.sleep(0.002)  # a grammar compiling
    out.close()
    return results, sched.stats(), sched


def _req(demo, i: int, rid: str | None = None, **params) -> messages.TokenizedGenerateReq:
    sp = SamplingParams(**{"max_new_tokens": 16, "temperature": 0, "logprobs": True, **params}).normalize()
    return messages.TokenizedGenerateReq(rid or f"r{i}", demo[4][i % len(demo[4])], sp, stream=True,
                                         return_logprob=True)


def test_overlap_gives_the_plain_loops_tokens_for_a_mixed_batch(demo):
    first = [
        _req(demo, 0, max_new_tokens=20, stop=["circlecircle"]),  # a stop string, found on the host
        _req(demo, 1, temperature=1.3, seed=12, max_new_tokens=24, top_logprobs_num=3),  # EOS, seeded sampling
        _req(demo, 2, max_new_tokens=5),
        _req(demo, 3, max_new_tokens=1),
        _req(demo, 4, temperature=1.3, seed=14, max_new_tokens=22, stop_token_ids=[398]),
        _req(demo, 5, temperature=0.9, seed=3, top_p=0.8, min_new_tokens=12, max_new_tokens=18),
    ]
    later = [  # arrive mid-run: admissions drain the pipeline; the grammar's rows never overlap
        _req(demo, 6, max_new_tokens=12, json_schema='{"type": "object", "properties": {"n": {"type": "integer"}}}'),
        _req(demo, 7, max_new_tokens=10, logit_bias={356: -5.0}),
    ]
    arrivals = {0: first, 4: later[:1], 7: later[1:]}
    plain, plain_stats, _ = _run(demo, False, arrivals)
    over, over_stats, sched = _run(demo, True, arrivals)
    assert sched.overlap is not None and sched.overlap.num_overlapped > 5
    assert set(over) == set(plain) == {f"r{i}" for i in range(8)}
    for rid in plain:
        a, b = plain[rid], over[rid]
        assert b["ids"] == a["ids"] and b["finish"] == a["finish"], rid
        assert b["lp"] == pytest.approx(a["lp"], abs=1e-4) and len(b["top"]) == len(a["top"]), rid
        for x, y in zip(a["top"], b["top"]):
            assert [t for t, _ in x] == [t for t, _ in y]
    reasons = [plain[r]["finish"] for r in sorted(plain)]
    assert FinishReason.stop("circlecircle") in reasons  # the paths the batch is meant to cover
    assert FinishReason.stop(2) in reasons  # EOS
    assert any(f.kind is FinishKind.LENGTH for f in reasons)
    for stats in (plain_stats, over_stats):
        assert stats.kv_used_tokens == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert over_stats.radix_cache_tokens == plain_stats.radix_cache_tokens  # riders' tokens are not cached
    assert over_stats.device_busy_s > 0
    assert not demo[3]._held and not demo[3]._state_slots


def test_abort_while_its_step_is_in_flight(demo):
    seen = {}

    def on_step(i, sched):
        # After iteration 3 a decode step is in flight: abort r1 then, as a client that disconnects would.
        if i == 3 and sched.overlap is not None:
            assert sched.overlap.inflight is not None
            used = sched.stats().kv_used_tokens
            sched.handle(messages.AbortReq("r1"))
            seen["deferred"] = [r.rid for r, *_ in sched.overlap.inflight.deferred]
            seen["kept"] = sched.stats().kv_used_tokens == used  # its KV stays until the step is collected
            seen["running"] = [r.rid for r in sched.policy.running]

    reqs = {0: [_req(demo, i, max_new_tokens=12, ignore_eos=True) for i in range(3)]}
    over, stats, _ = _run(demo, True, reqs, on_step)
    plain, _, _ = _run(demo, False, reqs)
    assert seen == {"deferred": ["r1"], "kept": True, "running": ["r0", "r2"]}
    assert over["r1"]["finish"].kind is FinishKind.ABORT and len(over["r1"]["ids"]) < 12
    assert over["r1"]["ids"] == plain["r1"]["ids"][:len(over["r1"]["ids"])]
    assert over["r0"]["ids"] == plain["r0"]["ids"] and over["r2"]["ids"] == plain["r2"]["ids"]
    assert stats.kv_used_tokens == 0 and stats.num_running == 0


def test_placeholders_resolve_from_the_previous_steps_ids():
    previous = torch.tensor([11, 22, 33])
    ids = torch.tensor([-3, 7, -1, -2])
    assert resolve_placeholders(ids, previous).tolist() == [33, 7, 11, 22]
    with pytest.raises(RuntimeError, match="no sampled step"):
        resolve_placeholders(ids, None)


def test_overlap_flags():
    assert not ServerArgs().overlap_schedule  # off by default (not yet run on a GPU)
    assert ServerArgs(enable_overlap_schedule=True).overlap_schedule
    assert not ServerArgs(enable_overlap_schedule=True, tp_size=2).overlap_schedule  # only rank 0 samples
    assert not ServerArgs(disable_overlap_schedule=True).overlap_schedule  # SGLang's flag is accepted
    with pytest.raises(ValueError, match="choose one"):
        ServerArgs(enable_overlap_schedule=True, disable_overlap_schedule=True)


def test_an_image_requests_decode_steps_overlap_with_its_positions(demo):
    """M-RoPE: an image prompt's decode positions continue from a delta, which the follow-on step (formed without
    the tokens) must carry as the plain step does."""
    from tessera.frontend.model_info import ModelInfo

    image = scene_question(ModelInfo.load(demo[0]))
    sp = SamplingParams(max_new_tokens=10, temperature=0, logprobs=True, ignore_eos=True).normalize()
    img = messages.TokenizedGenerateReq("img", list(image.input_ids), sp, mm_inputs=image.mm_inputs, stream=True,
                                        return_logprob=True)
    arrivals = {0: [img, _req(demo, 2, max_new_tokens=8, ignore_eos=True)]}
    plain, _, _ = _run(demo, False, arrivals)
    over, stats, sched = _run(demo, True, arrivals)
    assert sched.overlap is not None and sched.overlap.num_overlapped >= 5
    assert over["img"]["ids"] == plain["img"]["ids"] and len(plain["img"]["ids"]) == 10
    assert over["r2"]["ids"] == plain["r2"]["ids"]
    assert over["img"]["lp"] == pytest.approx(plain["img"]["lp"], abs=1e-4)
    assert stats.kv_used_tokens == 0 and not demo[3]._held
