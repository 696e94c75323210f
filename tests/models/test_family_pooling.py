"""Every family's final hidden states for embedding requests (ForwardBatch.hidden_indices) are transformers'
base model's `last_hidden_state` (after the final norm), on the parity suite's tiny checkpoints and prompts;
pooled and normalised the way worker/pooling.py does, prefilled whole and in chunks."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.pooling import PoolingParams
from tessera.messages.worker import PoolingRows
from tessera.worker.pooling import Pooler, hidden_rows
from tests.models.family_parity import ATOL
from tests.models.paged_driver import PagedKV, make_batch
from tests.models.test_family_parity import built_cases, case, each_case  # noqa: F401 (fixtures)


def hf_last_hidden(case, prompt) -> torch.Tensor:
    """HF's final-norm hidden states [L, H]: the base model's last_hidden_state (HF's hidden_states[-1])."""
    with torch.inference_mode():
        out = case.hf(**case.hf_inputs(prompt), output_hidden_states=True)
    return out.hidden_states[-1][0]


def our_pooled(case, prompt, method: str, chunk: int | None) -> torch.Tensor:
    """The pooled vector through the worker's Pooler, the prompt prefilled whole or in chunks."""
    kv = PagedKV(case.ours.lm_config, page_size=2, max_context_len=512)
    row = kv.new_request()
    pooler, params = Pooler(), PoolingParams(method, normalize=True)
    cuts = case.chunks(prompt, chunk) if chunk else [(0, len(prompt))]
    out: list[torch.Tensor] = []
    for lo, hi in cuts:
        fb = make_batch(kv, [case.extend_step(row, prompt, lo, hi)])
        entry = PoolingRows(0, 0, lo, hi - lo, hi == len(prompt), params)
        fb.hidden_indices = torch.tensor(hidden_rows([entry]), dtype=torch.int64)
        with torch.inference_mode():
            case.ours(fb, kv.pool)
        out += pooler.pool(fb.hidden_states, [entry], ["r"])
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("case,method", each_case(lambda fx: ("last", "mean", "cls")), indirect=["case"])
def test_pooled_hidden_states_match_hf(case, method):
    prompt = case.prompt(next(iter(case.row.prompts.values())), seed=1)
    hidden = hf_last_hidden(case, prompt)
    # HF's hidden_states[-1] is the base model's output after its final norm: its LM head gives HF's logits.
    torch.testing.assert_close(case.ours.lm_head(hidden), case.hf_logits(prompt), atol=ATOL, rtol=0)
    ref = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    ref = torch.nn.functional.normalize(ref, dim=-1)
    for chunk in (None, max(2, len(prompt) // 3)):
        ours = our_pooled(case, prompt, method, chunk)
        assert float(torch.nn.functional.cosine_similarity(ours, ref, dim=0)) >= 0.99999
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
