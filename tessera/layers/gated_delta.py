"""Gated DeltaNet's token mixer (Qwen3-Next, Qwen3.5): a causal depthwise conv1d, then linear attention whose
[heads, key_dim, value_dim] state follows the gated delta rule, read and written in the state pool
(cache/state_pool.py) at each request's slot.

The rule, per value head, token t (q, k L2-normalised, q scaled by key_dim^-0.5):
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
Decode runs it for one token per request, batched over requests. Prefill runs the chunked form (64 tokens per
chunk: a unit-triangular solve turns a chunk's updates into a few matmuls; the DeltaNet paper's WY/UT form),
one request at a time from the state its previous chunk left, so chunked prefill computes what one long
prefill would. On CUDA the kernels of flash-linear-attention (`fla-core`, an optional import: not a dependency)
replace both where it is installed; that path has not run in this repository's tests (no fla-core here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.platform.device import platform_of

try:  # optional: flash-linear-attention's Triton kernels (CUDA only); the torch forms below are the reference
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk  # type: ignore[import-not-found]
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent  # type: ignore
except ImportError:  # not installed: the torch forms run
    _fla_chunk = _fla_recurrent = None

CHUNK = 64


def _runs_fla(x: torch.Tensor) -> bool:
    """fla-core's kernels are Triton's: they run where the platform runs Triton (CUDA)."""
    return platform_of(x.device).runs_triton


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[T, Hk, Dk] q/k, [T, Hv, Dv] v, [T, Hv] g/beta -> float32 [Hv, T, .] with q/k repeated to the value
    heads, L2-normalised, q scaled."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.t().float(), beta.t().float()


def recurrent_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token per request: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; state [B, Hv, Dk, Dv] float32,
    updated in place. Returns o [B, Hv, Dv] float32."""
    if _fla_recurrent is not None and _runs_fla(q):  # fla takes Hk < Hv heads itself (grouped value heads)
        o, final = _fla_recurrent(q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None],
                                  initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        state.copy_(final)
        return o[:, 0].float()
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = l2norm(q.float()), l2norm(k.float()), v.float()
    q = q * q.shape[-1] ** -0.5
    state.mul_(g.float().exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta.float()[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One request's tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]; state [Hv, Dk, Dv] float32, updated
    in place. Returns o [T, Hv, Dv] float32."""
    if _fla_chunk is not None and _runs_fla(q):
        o, final = _fla_chunk(q[None], k[None], v[None], g[None].float(), beta[None], initial_state=state[None],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        state.copy_(final[0])
        return o[0].float()
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    n = q.shape[1]
    pad = (-n) % CHUNK
    if pad:  # padded tokens: zero key/value/beta and no decay, so they change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, -1, CHUNK), beta.reshape(h, -1, CHUNK)
    cum = g.cumsum(-1)  # log decay from the chunk's start to each token
    below = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~below, float("-inf")).exp()  # token j -> i
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Within a chunk the updates chain: u_i = beta_i v_i - sum_{j<i} (k_beta_i . k_j) decay_ij u_j; solving the
    # unit lower-triangular system gives every token's write at once (and w for the part the old state predicts).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        new = u[:, c] - w[:, c] @ state  # what the state does not already predict
        out[:, c] = (q[:, c] * cum[:, c, :, None].exp()) @ state + scores[:, c] @ new
        last = cum[:, c, -1]
        state.mul_(last.exp()[:, None, None])
        state.add_((k[:, c] * (last[:, None] - cum[:, c]).exp()[..., None]).transpose(-1, -2) @ new)
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1)


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d of one request's new inputs x [T, C] after the K-1 inputs kept in conv_state
    [C, K-1] (zeros for a new request); conv_state is updated in place; SiLU applied. Returns [T, C]."""
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+T]
    conv_state.copy_(full[:, -conv_state.shape[-1]:])
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t()


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """conv_step for one token per request, batched: x [B, C], conv_state [B, C, K-1] (a gathered copy the
    caller writes back). Returns [B, C]."""
    full = torch.cat([conv_state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    conv_state.copy_(full[..., 1:])
    return F.silu((full * weight).sum(-1))
