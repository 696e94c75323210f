"""lm-evaluation-harness against `tessera serve`, run as its users run it: `local-completions` with demo-vl's
tokenizer, token-id prompts (its default), batches of 4, on two task files of ours (lm_eval_tasks/, local data).

The multiple-choice task is scored from echoed prompt logprobs (echo + logprobs 1 + max_tokens 1): every choice's
log-likelihood must equal HF transformers' on the same token ids (fp32 demo-vl). The generate_until task's answers
must be HF's greedy continuations cut at the task's stop strings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import ASSETS_DIR

DEMO = ASSETS_DIR / "demo-vl"
TASKS = Path(__file__).parent / "lm_eval_tasks"
MC, GEN = "tessera_scenes_mc", "tessera_scenes_gen"


@pytest.fixture(scope="module")
def harness(vl_server, tmp_path_factory):
    """lm-eval's results (samples logged) and the LM it built, whose encoder gives the ids it sent."""
    with pytest.MonkeyPatch.context() as mp:
        # datasets reads these when imported: nothing may be downloaded, nothing cached outside the test's folder
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        mp.chdir(TASKS)  # the task files name their data relative to their folder
        import lm_eval
        from lm_eval.api.registry import get_model
        from lm_eval.tasks import TaskManager

        args = dict(model="demo-vl", base_url=f"{vl_server.base_url}/v1/completions", tokenizer=str(DEMO),
                    tokenizer_backend="huggingface", batch_size=4, max_retries=1, timeout=120)
        results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[MC, GEN],
                                          task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                          log_samples=True, bootstrap_iters=0)
        return results, get_model("local-completions")(**args)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(DEMO, dtype=torch.float32).eval()


@torch.no_grad()
def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(lp[p - 1, ids[p]].item() for p in range(len(context), len(ids)))


def test_multiple_choice_loglikelihoods_equal_hf(harness, hf_model):
    results, lm = harness
    samples = results["samples"][MC]
    assert len(samples) == 8
    correct = []
    for s in samples:
        got = [resp[0][0] for resp in s["resps"]]
        want = [hf_loglikelihood(hf_model, *lm._encode_pair(context, continuation))
                for context, continuation in s["arguments"]]
        assert len(got) == len(s["doc"]["choices"]) >= 3
        assert got == pytest.approx(want, abs=1e-3)
        assert [r[0] for r in s["filtered_resps"]] == got
        correct.append(max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"])
    assert results["results"][MC]["acc,none"] == pytest.approx(sum(correct) / len(correct))


@torch.no_grad()
def test_generate_until_answers_are_hf_greedy(harness, hf_model):
    results, lm = harness
    samples = results["samples"][GEN]
    assert len(samples) == 4
    tok = lm.tokenizer
    matches = []
    for s in samples:
        (context, gen_kwargs), = s["arguments"]
        ids = tok.encode(context, add_special_tokens=False)
        out = hf_model.generate(input_ids=torch.tensor([ids]), max_new_tokens=gen_kwargs["max_gen_toks"],
                                do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        for stop in gen_kwargs["until"]:
            text = text.split(stop)[0]
        assert s["resps"] == [[text]]
        matches.append(text == s["target"])
    assert any(s["resps"][0][0] for s in samples)  # the model answered something
    assert results["results"][GEN]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))
