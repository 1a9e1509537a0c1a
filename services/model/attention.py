"""Softmax attention kernels shared by the MLA, GQA and SWA layers, each with a slow reference.

- `causal_attention`: queries are the last T of L keys (a prefill resumed after P = L - T
  cached tokens). P == 0 is SDPA with is_causal; otherwise queries go in chunks, each with
  an explicit bottom-right-aligned mask, so no T x L matrix is ever built at once. In bf16
  on a CPU with AVX512-BF16 but no AMX it is `causal_attention_rows` instead (below).
- `causal_attention_rows`: the same maths a block of query rows and one head at a time,
  through oneDNN. torch's CPU flash kernel multiplies bf16 through MKL, which on such CPUs
  widened both operands to fp32 and ran MKL's fp32 kernel, as slow as in fp32
  (docs/engineering-notes.md 3d). Here Q K^T is oneDNN's fp32 matmul (exact products of the
  bf16 inputs, fp32 sums), the softmax runs in fp32, and P V is oneDNN's bf16 matmul on P
  rounded to bf16 (as the flash kernel rounds it).
  Where the CPU has AMX the flash kernel takes oneDNN's AMX path, so it is kept.
- `sliding_window_attention`: a query at position t sees keys t - W .. t (the W previous
  tokens and itself; the request state is the last W tokens' K/V). Learnable sinks add one
  logit per query head to the softmax denominator (docs/paper-notes.md section 6.2). Computed block-
  locally: queries of a W-block attend to their block and the previous one, never T x T.
- `window_decode_attention`: one query per request against its ring of W slots plus itself.
- `ragged_decode_attention`: one query per request against its own full-attention KV (lengths
  differ): the requests' keys are packed into one zero-padded fp32 batch and attended with
  two batched matmuls and a masked softmax, instead of one SDPA call per request (a
  single-query SDPA call on CPU costs most of what a batch's decode step may take:
  docs/engineering-notes.md 3d).
- `padded_decode_attention`: the same over a decode batch's zero-padded KV (`PaddedKV`), with
  the matmuls in the cache's dtype: no per-step copy or fp32 conversion of the cached tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.precision import cpu_flags, cpu_has_native_bf16

# Query rows per chunk of a resumed causal prefill: bounds the mask to CHUNK x L booleans.
_QUERY_CHUNK = 1024
# Query blocks of W processed together in sliding-window prefill (bounds the score tensor).
_WINDOW_GROUP = 16
# Query rows per block of `causal_attention_rows`: a block's fp32 scores are ROWS x L per
# head (4 MiB at L = 4096). 256 and 512 measured alike at 4K, 128 10-20% slower (Zen 5).
_ROWS = 256


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """q [B, Hq, T, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv] with L >= T -> [B, Hq, T, Dv].

    Query i sits at position L - T + i and sees keys 0 .. L - T + i.
    """
    t, length = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if rows_kernel_applies(q, k, v):
        return causal_attention_rows(q, k, v, scale)
    if t == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    prefix = length - t
    outputs = []
    for start in range(0, t, _QUERY_CHUNK):
        end = min(t, start + _QUERY_CHUNK)
        rows = torch.arange(prefix + start, prefix + end, device=q.device)[:, None]
        cols = torch.arange(prefix + end, device=q.device)[None, :]
        outputs.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, : prefix + end], v[:, :, : prefix + end],
            attn_mask=cols <= rows, scale=scale, enable_gqa=gqa,
        ))
    return torch.cat(outputs, dim=2)


def rows_kernel_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """`causal_attention` takes `causal_attention_rows`: bf16 on a CPU with native bf16 dot
    products but no AMX, no autograd, and oneDNN's fp32 linear present (`_onednn_linear`)."""
    if not q.dtype == k.dtype == v.dtype == torch.bfloat16:
        return False
    if q.device.type != "cpu" or q.shape[2] == 0:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return _rows_kernel_host()


@functools.cache
def _rows_kernel_host() -> bool:
    return cpu_has_native_bf16() and "amx_bf16" not in cpu_flags() and _onednn_linear()


@functools.cache
def _onednn_linear() -> bool:
    """oneDNN's fp32 linear (a torch-private op, so checked rather than assumed) exists and
    agrees with `F.linear` on a plain weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 24, generator=generator), torch.randn(7, 24, generator=generator)
    try:
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return isinstance(out, Tensor) and bool(torch.allclose(out, F.linear(x, w), atol=1e-5))


def causal_attention_rows(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """`causal_attention` a block of _ROWS query rows and one query head at a time (contract
    and GQA head mapping as SDPA's): fp32 scores from oneDNN's linear on the fp32 copies of
    q (times the scale) and k, the causal mask on the block's diagonal square only, an fp32
    softmax, then P in v's dtype times v. Inference only; any dtype, fastest in bf16 (see the
    module docstring). The result is a [B, Hq, T, Dv] view of a [B, T, Hq, Dv] tensor, so a
    caller that merges the heads gets them without a copy.
    """
    b, hq, t, d = q.shape
    hkv, length, dv = k.shape[1], k.shape[2], v.shape[3]
    group, prefix = hq // hkv, length - t
    # Contiguous fp32 copies (never q itself, which is scaled here; torch.mul(q, s, out=)
    # would multiply in q's dtype and round before widening).
    qf = q.new_empty(q.shape, dtype=torch.float32).copy_(q).mul_(scale or d**-0.5)
    kf = k.new_empty(k.shape, dtype=torch.float32).copy_(k)
    vc = v.contiguous()
    out = q.new_empty(b, t, hq, dv, dtype=v.dtype)
    rows = min(_ROWS, t)
    hidden = torch.full((rows, rows), float("-inf"), device=q.device).triu_(1)
    onednn = q.device.type == "cpu" and _onednn_linear()
    for i in range(b):
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            n, end = r1 - r0, prefix + r1  # query r0 + a sees keys 0 .. prefix + r0 + a
            for h in range(hq):
                keys = kf[i, h // group, :end]
                if onednn:
                    scores = torch.ops.mkldnn._linear_pointwise(qf[i, h, r0:r1], keys, None,
                                                                "none", [], "")
                else:
                    scores = qf[i, h, r0:r1] @ keys.T
                scores[:, end - n :].add_(hidden[:n, :n])
                probs = scores.softmax(-1).to(v.dtype)
                torch.mm(probs, vc[i, h // group, :end], out=out[i, r0:r1, h])
    return out.transpose(1, 2)


def _expand_heads(x: Tensor, n_heads: int) -> Tensor:
    """[B, Hkv, L, D] -> [B, Hq, L, D] by repeating each key-value head."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor,
                               scale: float | None = None) -> Tensor:
    """The obvious masked softmax(Q K^T) V in fp32; same contract as `causal_attention`."""
    t, length, hq = q.shape[2], k.shape[2], q.shape[1]
    kf, vf = _expand_heads(k.float(), hq), _expand_heads(v.float(), hq)
    scores = q.float() @ kf.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)  # [B, Hq, T, L]
    rows = torch.arange(length - t, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > rows, float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


def _softmax_with_sink(scores: Tensor, sink: Tensor | None) -> Tensor:
    """softmax over the last axis with an extra sink logit in the denominator only.

    scores [..., N] (fp32, may be overwritten); sink broadcastable to scores[..., :1] or
    None (plain softmax). Computed in place, without concatenating a sink column.
    """
    if sink is None:
        return scores.softmax(-1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink).detach()  # [..., 1]
    if scores.requires_grad:
        # Training: autograd needs exp's output intact, so no in-place steps.
        probs = (scores - top).exp()
        return probs / (probs.sum(-1, keepdim=True) + (sink - top).exp())
    probs = scores.sub_(top).exp_()
    return probs.div_(probs.sum(-1, keepdim=True) + (sink - top).exp())


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int,
                             sinks: Tensor | None, scale: float | None = None) -> Tensor:
    """q [B, T, Hq, D]; k, v [B, P + T, Hkv, D] where the first P <= W keys precede the
    queries (the cached window); sinks [Hq] or None -> [B, T, Hq, D].

    Query i (position P + i in k) sees keys P + i - W .. P + i. Keys are laid out in
    W-blocks after W - P leading pads, so query block b needs exactly key blocks b, b + 1.
    """
    b, t, hq, d = q.shape
    hkv, prefix = k.shape[2], k.shape[1] - t
    group, n_blocks = hq // hkv, -(-t // window)
    scale = scale or d**-0.5
    pad_front, pad_back = window - prefix, n_blocks * window - t
    kp = F.pad(k, (0, 0, 0, 0, pad_front, pad_back)).view(b, n_blocks + 1, window, hkv, d)
    vp = F.pad(v, (0, 0, 0, 0, pad_front, pad_back)).view(b, n_blocks + 1, window, hkv, d)
    # The scale is folded into the (smaller) queries rather than applied to the scores.
    qp = F.pad(q.float() * scale, (0, 0, 0, 0, 0, pad_back))
    qp = qp.view(b, n_blocks, window, hkv, group, d)
    r = torch.arange(window, device=q.device)[:, None]
    c = torch.arange(2 * window, device=q.device)[None, :]
    band = (c >= r) & (c <= r + window)  # [W, 2W]
    sink = None if sinks is None else sinks.float().view(1, 1, hkv, group, 1, 1)
    out = []
    for g0 in range(0, n_blocks, _WINDOW_GROUP):
        g1 = min(n_blocks, g0 + _WINDOW_GROUP)
        keys = torch.cat((kp[:, g0:g1], kp[:, g0 + 1 : g1 + 1]), dim=2)  # [B, n, 2W, Hkv, D]
        vals = torch.cat((vp[:, g0:g1], vp[:, g0 + 1 : g1 + 1]), dim=2)
        scores = torch.einsum("bnrhgd,bnchd->bnhgrc", qp[:, g0:g1], keys.float())
        block_start = torch.arange(g0, g1, device=q.device)[:, None, None] * window
        allowed = band & (block_start + c >= pad_front)  # [n, W, 2W]
        scores.masked_fill_(~allowed[None, :, None, None], float("-inf"))
        probs = _softmax_with_sink(scores, sink)
        out.append(torch.einsum("bnhgrc,bnchd->bnrhgd", probs, vals.float()))
    o = torch.cat(out, dim=1).reshape(b, n_blocks * window, hq, d)[:, :t]
    return o.to(q.dtype)


def sliding_window_attention_reference(q: Tensor, k: Tensor, v: Tensor, window: int,
                                       sinks: Tensor | None,
                                       scale: float | None = None) -> Tensor:
    """Full T x (P + T) masked softmax with a sink column; same contract as the fast path."""
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    length = k.shape[1]
    qf = q.float().transpose(1, 2)  # [B, Hq, T, D]
    kf = _expand_heads(k.float().transpose(1, 2), hq)
    vf = _expand_heads(v.float().transpose(1, 2), hq)
    scores = qf @ kf.transpose(-1, -2) * (scale or d**-0.5)  # [B, Hq, T, L]
    rows = torch.arange(length - t, length)[:, None]
    cols = torch.arange(length)[None, :]
    scores = scores.masked_fill((cols > rows) | (cols < rows - window), float("-inf"))
    sink = None if sinks is None else sinks.float().view(1, hq, 1, 1)
    o = _softmax_with_sink(scores, sink) @ vf  # [B, Hq, T, D]
    return o.transpose(1, 2).to(q.dtype)


def window_decode_attention(q: Tensor, ring_k: Tensor, ring_v: Tensor, k_new: Tensor,
                            v_new: Tensor, positions: Tensor, sinks: Tensor | None,
                            scale: float | None = None) -> Tensor:
    """One decode query per request. q [B, Hq, D]; rings [B, W, Hkv, D] holding tokens
    before `positions` [B]; k_new, v_new [B, Hkv, D] at `positions` -> [B, Hq, D].

    Ring slot s is filled iff s < position (until the ring wraps, then all are).
    """
    b, hq, d = q.shape
    window, hkv = ring_k.shape[1], ring_k.shape[2]
    keys = torch.cat((ring_k, k_new[:, None]), dim=1).float()  # [B, W + 1, Hkv, D]
    vals = torch.cat((ring_v, v_new[:, None]), dim=1).float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bchd->bhgc", qg, keys) * (scale or d**-0.5)
    slots = torch.arange(window + 1, device=q.device)[None, :]
    filled = (slots < positions[:, None]) | (slots == window)  # [B, W + 1]
    scores = scores.masked_fill(~filled[:, None, None], float("-inf"))
    sink = None if sinks is None else sinks.float().view(1, hkv, hq // hkv, 1)
    probs = _softmax_with_sink(scores, sink)
    return torch.einsum("bhgc,bchd->bhgd", probs, vals).reshape(b, hq, d).to(q.dtype)


def ragged_decode_attention(q: Tensor, keys: list[Tensor], values: list[Tensor] | None,
                            scale: float | None = None) -> Tensor:
    """q [B, Hq, D]; keys[i] [Hkv, L_i, D], values[i] [Hkv, L_i, Dv] (None: the keys are the
    values, MLA's latent) -> [B, Hq, Dv] in q's dtype. Scores and sums run in fp32."""
    b, hq, d = q.shape
    hkv = keys[0].shape[0]
    k = _pack(keys)  # [B, Hkv, Lmax, D] fp32
    v = k if values is None else _pack(values)
    lengths = torch.tensor([x.shape[1] for x in keys], device=q.device)
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = qg @ k.transpose(-1, -2)  # [B, Hkv, G, Lmax]
    scores.mul_(scale or d**-0.5)
    pad = torch.arange(k.shape[2], device=q.device)[None, :] >= lengths[:, None]  # [B, Lmax]
    scores.masked_fill_(pad[:, None, None], float("-inf"))
    out = scores.softmax(-1) @ v  # [B, Hkv, G, Dv]
    return out.view(b, hq, v.shape[-1]).to(q.dtype)


def padded_decode_attention(q: Tensor, k: Tensor, v: Tensor | None, lengths: Tensor,
                            scale: float | None = None) -> Tensor:
    """q [B, Hq, D]; k [B, Hkv, Lmax, D], v [B, Hkv, Lmax, Dv] (None: the keys are the values)
    with request i's tokens at [i, :, :lengths[i]] -> [B, Hq, Dv] in q's dtype.

    Both matmuls run in the inputs' dtype (bf16 on CPU: fp32 accumulation, scores rounded
    once to bf16); the scale, mask and softmax run in fp32. Past lengths[i] the keys must be
    finite (they are masked; their values are multiplied by zero).
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.to(k.dtype).view(b, hkv, hq // hkv, d)
    scores = (qg @ k.transpose(-1, -2)).float()  # [B, Hkv, G, Lmax]
    scores.mul_(scale or d**-0.5)
    pad = torch.arange(k.shape[2], device=q.device)[None, :] >= lengths[:, None]  # [B, Lmax]
    scores.masked_fill_(pad[:, None, None], float("-inf"))
    values = k if v is None else v
    out = scores.softmax(-1).to(values.dtype) @ values  # [B, Hkv, G, Dv]
    return out.view(b, hq, values.shape[-1]).to(q.dtype)


def _pack(parts: list[Tensor]) -> Tensor:
    """[A, L_i, X] tensors -> [B, A, Lmax, X] fp32, zero past each L_i (one copy each)."""
    a, x = parts[0].shape[0], parts[0].shape[2]
    longest = max(p.shape[1] for p in parts)
    out = torch.empty(len(parts), a, longest, x, dtype=torch.float32, device=parts[0].device)
    for row, part in zip(out, parts, strict=True):
        row[:, : part.shape[1]].copy_(part)
        # Masked scores ignore padded keys, but 0 * NaN in probs @ values would not.
        row[:, part.shape[1] :].zero_()
    return out


def ragged_decode_attention_reference(q: Tensor, keys: list[Tensor], values: list[Tensor] | None,
                                      scale: float | None = None) -> Tensor:
    """One SDPA call per request; same contract as `ragged_decode_attention`."""
    out = []
    for i, k in enumerate(keys):
        v = k if values is None else values[i]
        out.append(F.scaled_dot_product_attention(
            q[i, :, None].float()[None], k.float()[None], v.float()[None], scale=scale,
            enable_gqa=True)[0, :, 0])
    return torch.stack(out).to(q.dtype)
