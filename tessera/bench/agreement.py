"""How closely two systems' greedy outputs agree on the same requests (Tessera vs HF in `tessera bench offline`).

Greedy outputs of two implementations split at the first step where float rounding flips an argmax (in bf16
this happens on near-tied logits even when both sides are right), and after a split they continue from
different texts, so only the prefix before the first divergence is compared, token by token and logprob by
logprob.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GreedyOutput:
    """One request's generated tokens and the logprob of each (None where the system reported none)."""

    token_ids: list[int]
    logprobs: list[float] | None = None


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where a and b differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(ours: list[GreedyOutput], ref: list[GreedyOutput]) -> dict:
    """Per request pair: the fraction of its tokens before the first divergence; over all requests: the mean
    of those fractions, the fraction of all tokens before each request's first divergence, the fraction of
    requests fully identical, and the largest |logprob difference| of the tokens both sides chose alike."""
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"agreement: {len(ours)} outputs against {len(ref)} references")
    prefix, total, identical, diffs = [], 0, 0, []
    for a, b in zip(ours, ref):
        n = max(len(a.token_ids), len(b.token_ids))
        k = first_divergence(a.token_ids, b.token_ids)
        prefix.append(k)
        total += n
        identical += a.token_ids == b.token_ids
        if a.logprobs is not None and b.logprobs is not None:
            diffs += [abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k])]
    lengths = [max(len(a.token_ids), len(b.token_ids)) for a, b in zip(ours, ref)]
    return {"requests": len(ours), "identical_requests": identical / len(ours),
            "prefix_fraction_mean": sum(k / max(n, 1) for k, n in zip(prefix, lengths)) / len(ours),
            "prefix_tokens_fraction": sum(prefix) / max(total, 1),
            "max_logprob_diff": max(diffs) if diffs else None,
            "mean_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
            "logprobs_compared": len(diffs)}


def format_agreement(a: dict) -> str:
    s = (f"{100 * a['prefix_tokens_fraction']:.1f}% of tokens before the first divergence (mean per request "
         f"{100 * a['prefix_fraction_mean']:.1f}%), {100 * a['identical_requests']:.0f}% of {a['requests']} "
         "requests identical")
    if a["max_logprob_diff"] is not None:
        s += f", |logprob diff| max {a['max_logprob_diff']:.4f} mean {a['mean_logprob_diff']:.5f} " \
             f"over {a['logprobs_compared']} tokens"
    return s
