"""Hardware profiles as data, the cost model built on them, and the pacer of emulated mode.

A profile (services/paper/profiles/<name>.toml) says how long one instance (8 GPUs) of a chip takes
to prefill l tokens and to run one decode step of the modeled model; the model file
(hybrid_1t.toml) says how many KV bytes a request of l tokens carries. `CostModel` answers
T_prefill(l), incremental prefill, decode step time and S_kv(l); the planner and the
cost-model (sim, emulated) workers all use it. `Pacer` turns modeled time into wall time.

Derivation of the profiles (paper: arXiv 2604.15039 v2; notes: docs/paper-notes.md)
-----------------------------------------------------------------------------------------
Lengths. Table 5's "1K, 8K, 32K, 128K" are read as 1000, 8000, 32000, 128000 tokens. With
the quadratic fit below this reproduces Table 6 best (scan of the four choices, t*, Lambda_max
and naive Lambda against 19.4K, 3.24, 2.45, t on a 100-token grid):
    decimal, quadratic   t* 19.4K (+0.0 %)  Lambda 3.247 (+0.2 %)  naive 2.469 (+0.8 %)
    decimal, piecewise   t* 19.9K (+2.6 %)  Lambda 3.137 (-3.2 %)  naive 2.455 (+0.2 %)
    binary,  quadratic   t* 19.2K (-1.0 %)  Lambda 3.299 (+1.8 %)  naive 2.516 (+2.7 %)
    binary,  piecewise   t* 19.6K (+1.0 %)  Lambda 3.195 (-1.4 %)  naive 2.501 (+2.1 %)
(the workload's upper bound is 131072 in all four; services/paper/workload.py says why).

H200 prefill (measured; Table 5, 8xH200, in-house vLLM): 0.44, 0.72, 1.84, 7.40 s. Least
squares T(l) = c0 + c1 l + c2 l^2 gives c0 = 0.3891 s, c1 = 4.2055e-5 s/token,
c2 = 9.9365e-11 s/token^2; fitted 0.431, 0.732, 1.837, 7.400 s, i.e. errors -2.0 %, +1.7 %,
-0.2 %, +0.0 %. A quadratic is the natural shape: linear per-token work (weights, KDA) plus
attention over the prefix in the full-attention (MLA) layers.

H20 prefill (derived, not in the paper). Table 6 gives PD-prefill stage throughputs on H20:
homogeneous PD, 9 prefill instances, 2.11 req/s over the whole distribution (mean 27,486
tokens), so T_H20(27,486) = 9 / 2.11 = 4.2654 s; PrfaaS-PD, 3 prefill instances, 1.64 req/s
over the requests at or below t = 19.4K (mean 10,224 tokens), so T_H20(10,224) = 3 / 1.64 =
1.8293 s. A pure ratio T_H20 = k T_H200 cannot meet both (k would be 2.67 and 2.25), so the
model is T_H20(l) = alpha + beta T_H200(l), solved through the two anchors: beta = 3.081,
alpha = -0.726 s, i.e. T_H20(l) = 0.473 s + 3.081 (c1 l + c2 l^2): a larger fixed cost and
3.1x the length-dependent work of H200 (the dense BF16 spec ratio, 989 / 148 TFLOPS = 6.7x,
is not what the paper's profile shows). This uses two of Table 6's numbers, so the
homogeneous Lambda_max (2.11) and PrfaaS-PD's Theta_pd-p (1.64) come back by construction;
t*, p, Theta_prfaas and the naive row remain independent checks (tests/test_planner.py).

KV size (Table 5, a model property): 190.8, 308.9, 701.3, 2316.3 MiB. Least squares
S(l) = fixed + per_token l gives 172.0 MiB + 17,555 B/token (errors -1.1 %, -1.0 %, +0.9 %,
-0.1 %): the fixed KDA recurrent and conv state plus the MLA latent KV per token.

Decode (derived from Table 6 and the SLO). Per-instance decode stage throughput is 3.91 / 5 =
2.35 / 3 = 6.25 / 8 = 0.78 req/s; the 40 tokens/s SLO fixes T_decode = 25 ms per step, so
Eq. 5 gives BS_max = 0.78125 * 1024 * 0.025 = 20 (then 5, 3, 8 instances give 3.91, 2.34,
6.25 req/s). The planner uses these SLO constants, as the paper does. For emulated workers,
`decode_step_time(batch, context)` = fixed + (batch * fixed KV bytes + context * KV bytes per
token) / HBM bandwidth: each step reads every sequence's cache once (8 x 4.0 TB/s on H20);
`fixed` (weights, mostly) is set so that 20 sequences of 28,000 tokens take exactly 25 ms.
H200 decode is not in the paper: assumed the same shape with HBM 4.8 TB/s per GPU and the
anchor step scaled by 4.0 / 4.8. The `cpu` profile models nothing: every time is 0.

Sources. Each part ([prefill], [decode], and the model's KV size) names its `source`: its kind
(measured, fitted, assumed) and from what. Here: H200 prefill and the KV size are measured
(the paper's Table 5); H20 prefill and H20 decode are fitted to Table 6, so the homogeneous
row's Lambda_max (2.11), Theta_pd-p (1.64) and the decode stage throughputs are reproduced by
construction; H200 decode is assumed (nothing in the simulation decodes on H200). Profiles
written by `prfaas profile` are measured on this machine's device.

Incremental prefill after a cached prefix of c tokens is modeled as T(c + l) - T(c) + c0:
the fixed cost once, the per-token work for the new tokens only, and the attention part
for new tokens attending to the whole prefix (the quadratic term's difference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

PROFILE_DIR = Path(__file__).parent / "profiles"
MIB = 2**20
_MAX_BASE_DEPTH = 4
_Spec = TypeVar("_Spec", "ProfileSpec", "ModelSpec")


class ProfileError(ValueError):
    """A hardware or model profile that is missing, malformed or inconsistent."""


SourceKind = Literal["measured", "fitted", "assumed"]


class Source(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a part of a profile comes from (module docstring, "Sources").

    kind: "measured" (timed on the device: the paper's Table 5, or `prfaas profile` here),
    "fitted" (solved from a system-level result, the paper's Table 6: what reproduces that
    table is reproduced by construction) or "assumed" (neither); detail: from what, in words.
    """

    kind: SourceKind
    detail: str


class PrefillSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fit: Literal["quadratic", "affine_of"]
    lengths: tuple[float, ...]
    seconds: tuple[float, ...]
    source: Source
    base: str = ""
    # Measured profiles (`prfaas profile`): the prefill chunk the times were taken with (0:
    # the whole prompt at once) and the fit's largest relative error over the points.
    chunk_tokens: int = 0
    fit_error: float = 0.0


class DecodeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SLO-governed decode constants of one instance (paper Eq. 5) and its HBM bandwidth."""

    bs_max: int
    step_s: float
    reference_context: int
    hbm_bytes_per_s: float
    source: Source
    # fit "hbm": the step is the fixed cost plus the KV read at HBM bandwidth (module
    # docstring). fit "linear": measured by `prfaas profile`; step times at (batch size,
    # tokens per sequence) points, fitted as fixed + per_sequence * batch + per_token *
    # context (`LinearDecode`); hbm_bytes_per_s is then unused. fit_error: the fit's largest
    # relative error over the points.
    fit: Literal["hbm", "linear"] = "hbm"
    batches: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()
    fit_error: float = 0.0


class ProfileSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    gpus_per_instance: int
    paced: bool
    sources: tuple[str, ...]
    prefill: PrefillSpec | None = None
    decode: DecodeSpec | None = None


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    sources: tuple[str, ...]
    kv_lengths: tuple[float, ...]
    kv_mib: tuple[float, ...]
    source: Source


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small dense system."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            f = rows[r][col] / rows[col][col]
            rows[r] = [a - f * b for a, b in zip(rows[r], rows[col], strict=True)]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i]
    return x


def _least_squares(cols: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Unconstrained least squares over the given columns (normal equations)."""
    normal = [[sum(a * b for a, b in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
    rhs = [sum(a * y for a, y in zip(ci, ys, strict=True)) for ci in cols]
    return _solve(normal, rhs)


def nonnegative_least_squares(cols: Sequence[Sequence[float]], ys: Sequence[float],
                              ) -> list[float]:
    """Least squares with every coefficient >= 0, exactly, for the few columns a cost fit has:
    the optimum is the unconstrained fit on some subset of the columns with no negative
    coefficient, so every subset is tried and the feasible one with the smallest residual
    wins. Where the plain fit is already non-negative it is the answer, unchanged. A measured
    profile needs this: a noisy quadratic can bend down at short lengths (a chunk's modeled
    time T(c + l) - T(c) + c0 then comes out negative), which no real engine does."""
    plain = _least_squares(cols, ys)
    if min(plain) >= 0.0:
        return plain
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 2 ** len(cols) - 1):
        chosen = [k for k in range(len(cols)) if mask >> k & 1]
        coef = _least_squares([cols[k] for k in chosen], ys)
        if min(coef) < 0.0:
            continue
        full = [0.0] * len(cols)
        for k, c in zip(chosen, coef, strict=True):
            full[k] = c
        fitted = [sum(full[k] * cols[k][i] for k in range(len(cols))) for i in range(len(ys))]
        residual = sum((f - y) ** 2 for f, y in zip(fitted, ys, strict=True))
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None:
        raise ProfileError("no non-negative fit: every measured time is negative")
    return best[1]


def polyfit(xs: Sequence[float], ys: Sequence[float], degree: int) -> tuple[float, ...]:
    """Least-squares polynomial coefficients (c0, c1, ...), fitted on x scaled to [0, 1]."""
    if len(xs) != len(ys) or len(xs) <= degree:
        raise ProfileError(f"need more than degree={degree} points, got {len(xs)} x, {len(ys)} y")
    scale = max(abs(x) for x in xs) or 1.0
    cols = [[(x / scale) ** k for x in xs] for k in range(degree + 1)]
    normal = [[sum(a * b for a, b in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
    rhs = [sum(a * y for a, y in zip(ci, ys, strict=True)) for ci in cols]
    return tuple(c / scale**k for k, c in enumerate(_solve(normal, rhs)))


def _independent(column: Sequence[float], basis: Sequence[Sequence[float]]) -> bool:
    """Whether `column` is not (numerically) a linear combination of the `basis` columns."""
    coef = _least_squares(basis, column)
    fitted = [sum(c * b[i] for c, b in zip(coef, basis, strict=True)) for i in range(len(column))]
    size = max(map(abs, column)) or 1.0
    return max(abs(f - y) for f, y in zip(fitted, column, strict=True)) > 1e-6 * size


@dataclass(frozen=True)
class QuadraticPrefill:
    """T_prefill(l) = c0 + c1 l + c2 l^2 + per_chunk * ceil(l / chunk) seconds for one
    instance, l in tokens.

    The last term is a chunked engine's cost per forward pass (weights read, kernels launched,
    Python dispatched), paid once per chunk whatever its length: a measured profile at chunk
    64 shows 141 and 179 tokens (three chunks each) within 4% of each other while 102 tokens
    (two chunks) take a third less. A profile without a chunk (`chunk` 0: the whole prompt
    in one pass, as the paper's GPU profiles) has none."""

    c0: float
    c1: float
    c2: float
    per_chunk: float = 0.0
    chunk: int = 0

    def chunks(self, length: float) -> int:
        """Forward passes of a prompt of `length` new tokens (0 without a chunk)."""
        return math.ceil(length / self.chunk) if self.chunk and length > 0 else 0

    def __call__(self, length: float) -> float:
        return (self.c0 + self.c1 * length + self.c2 * length * length
                + self.per_chunk * self.chunks(length))

    def extend(self, new: float, cached: float) -> float:
        """Seconds to prefill `new` tokens after `cached` ones, chunked from the cached
        boundary: c0 once, the tokens' linear and attention terms, one charge per chunk."""
        top = cached + new
        return (self.c0 + self.c1 * new + self.c2 * (top * top - cached * cached)
                + self.per_chunk * self.chunks(new))

    @classmethod
    def fit(cls, lengths: Sequence[float], seconds: Sequence[float],
            chunk: int = 0) -> QuadraticPrefill:
        """Least squares with non-negative coefficients: a prefill never takes less time for
        more tokens, nor less than nothing. With a chunk the per-chunk term joins the fit when
        the points can tell it apart (five or more, not all a whole number of chunks, the
        chunk counts not a line in the lengths)."""
        if len(lengths) != len(seconds) or len(lengths) < 3:
            raise ProfileError(f"a quadratic prefill fit needs >= 3 paired points, got "
                               f"{len(lengths)} lengths and {len(seconds)} times")
        # Columns scaled to [0, 1] so the normal equations stay well conditioned.
        scale = max(abs(x) for x in lengths) or 1.0
        cols = [[(x / scale) ** k for x in lengths] for k in range(3)]
        probe = cls(0.0, 0.0, 0.0, 1.0, chunk)
        counts = [float(probe.chunks(x)) for x in lengths]
        if chunk and len(lengths) >= 5 and _independent(counts, cols[:2]):
            *quad, per_chunk = nonnegative_least_squares([*cols, counts], seconds)
            c0, c1, c2 = (c / scale**k for k, c in enumerate(quad))
            return cls(c0, c1, c2, per_chunk, chunk)
        c0, c1, c2 = (c / scale**k
                      for k, c in enumerate(nonnegative_least_squares(cols, seconds)))
        return cls(c0, c1, c2)

    def affine(self, alpha: float, beta: float) -> QuadraticPrefill:
        """alpha + beta * T(l), of the same form."""
        return QuadraticPrefill(alpha + beta * self.c0, beta * self.c1, beta * self.c2,
                                beta * self.per_chunk, self.chunk)


@dataclass(frozen=True)
class LinearDecode:
    """A measured decode step: fixed_s + per_sequence_s * batch + per_token_s * context
    seconds, context being the tokens the whole batch holds. On a CPU the step is the weights'
    matmuls (fixed, and per sequence) plus attention over every cached token."""

    fixed_s: float
    per_sequence_s: float
    per_token_s: float

    def __call__(self, batch: int, context: int) -> float:
        return self.fixed_s + self.per_sequence_s * batch + self.per_token_s * context

    @classmethod
    def fit(cls, batches: Sequence[int], contexts: Sequence[int], seconds: Sequence[float],
            ) -> LinearDecode:
        """Least squares over points of (batch size, tokens per sequence, step seconds)."""
        rows = [(1.0, float(b), float(b * c)) for b, c in zip(batches, contexts, strict=True)]
        if len(rows) != len(seconds) or len(rows) < 3:
            raise ProfileError(f"a linear decode fit needs >= 3 paired points, got "
                               f"{len(rows)} points and {len(seconds)} times")
        # Columns scaled to [0, 1] so the normal equations stay well conditioned.
        scale = [max(abs(r[k]) for r in rows) or 1.0 for k in range(3)]
        cols = [[r[k] / scale[k] for r in rows] for k in range(3)]
        # Non-negative, as the prefill fit: no step gets cheaper with a larger batch.
        fixed, per_seq, per_token = (
            c / s for c, s in zip(nonnegative_least_squares(cols, seconds), scale, strict=True))
        return cls(fixed, per_seq, per_token)


def relative_errors(fitted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """(fitted - measured) / measured per point: what a profile's fit_error summarises."""
    return [f / m - 1.0 for f, m in zip(fitted, measured, strict=True)]


@dataclass(frozen=True)
class KVSize:
    """S_kv(l) = fixed_bytes + bytes_per_token * l: the bytes one request's KV cache holds."""

    fixed_bytes: float
    bytes_per_token: float

    def __call__(self, length: float) -> float:
        return self.fixed_bytes + self.bytes_per_token * length


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpus_per_instance: int
    paced: bool
    sources: tuple[str, ...]
    prefill: QuadraticPrefill | None
    prefill_points: tuple[tuple[float, float], ...]
    decode: DecodeSpec | None
    prefill_source: Source | None = None
    decode_fit: LinearDecode | None = None  # a measured decode (DecodeSpec fit "linear")

    def source_kinds(self) -> dict[str, SourceKind]:
        """Each modeled part's kind of source: {"prefill": ..., "decode": ...}."""
        kinds: dict[str, SourceKind] = {}
        if self.prefill_source is not None:
            kinds["prefill"] = self.prefill_source.kind
        if self.decode is not None:
            kinds["decode"] = self.decode.source.kind
        return kinds


@dataclass(frozen=True)
class ModelProfile:
    name: str
    description: str
    sources: tuple[str, ...]
    kv: KVSize
    kv_points: tuple[tuple[float, float], ...]
    source: Source


def _resolve(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    if text.endswith(".toml") or "/" in text:
        return Path(text)
    return PROFILE_DIR / f"{text}.toml"


def _read_spec(name_or_path: str | Path, kind: type[_Spec]) -> _Spec:
    path = _resolve(name_or_path)
    try:
        return msgspec.toml.decode(path.read_bytes(), type=kind)
    except FileNotFoundError as exc:
        raise ProfileError(f"profile {str(name_or_path)!r}: no such file {path}") from exc
    except msgspec.DecodeError as exc:
        raise ProfileError(f"profile {str(name_or_path)!r} ({path}): {exc}") from exc


def read_profile_spec(name_or_path: str | Path) -> ProfileSpec:
    """A hardware profile's TOML as written: its measured points, before any fit."""
    return _read_spec(name_or_path, ProfileSpec)


def _check_points(where: str, lengths: Sequence[float], values: Sequence[float]) -> None:
    if len(lengths) != len(values) or not lengths:
        raise ProfileError(f"{where}: lengths and values must pair up, got "
                           f"{len(lengths)} and {len(values)}")
    for x in (*lengths, *values):
        if not (math.isfinite(x) and x > 0):
            raise ProfileError(f"{where}: every length and value must be > 0, got {x!r}")


def _prefill_model(spec: ProfileSpec, origin: Path, depth: int) -> QuadraticPrefill:
    pre = spec.prefill
    assert pre is not None
    where = f"profile {spec.name!r} [prefill]"
    _check_points(where, pre.lengths, pre.seconds)
    if pre.fit == "quadratic":
        return QuadraticPrefill.fit(pre.lengths, pre.seconds, pre.chunk_tokens)
    if len(pre.lengths) != 2 or not pre.base:
        raise ProfileError(f"{where}: fit 'affine_of' needs base and exactly 2 anchors, got "
                           f"base={pre.base!r}, {len(pre.lengths)} anchors")
    base = _load_profile(origin.parent / f"{pre.base}.toml", depth + 1).prefill
    if base is None:
        raise ProfileError(f"{where}: base profile {pre.base!r} has no prefill model")
    (l1, l2), (t1, t2) = pre.lengths, pre.seconds
    beta = (t1 - t2) / (base(l1) - base(l2))
    return base.affine(t1 - beta * base(l1), beta)


def _load_profile(path: Path, depth: int) -> HardwareProfile:
    if depth > _MAX_BASE_DEPTH:
        raise ProfileError(f"profile {path}: base chain deeper than {_MAX_BASE_DEPTH}")
    spec = _read_spec(path, ProfileSpec)
    if spec.paced and (spec.prefill is None or spec.decode is None):
        raise ProfileError(f"profile {spec.name!r}: paced = true needs [prefill] and [decode]")
    prefill = _prefill_model(spec, path, depth) if spec.prefill is not None else None
    points = tuple(zip(spec.prefill.lengths, spec.prefill.seconds, strict=True)) if (
        spec.prefill is not None) else ()
    return HardwareProfile(spec.name, spec.description, spec.gpus_per_instance, spec.paced,
                           spec.sources, prefill, points, spec.decode,
                           spec.prefill.source if spec.prefill is not None else None,
                           _decode_model(spec))


def _decode_model(spec: ProfileSpec) -> LinearDecode | None:
    """The measured decode fit of a [decode] with fit "linear"; None for the HBM model."""
    dec = spec.decode
    if dec is None or dec.fit == "hbm":
        return None
    where = f"profile {spec.name!r} [decode]"
    if not len(dec.batches) == len(dec.contexts) == len(dec.seconds):
        raise ProfileError(f"{where}: batches, contexts and seconds must pair up, got "
                           f"{len(dec.batches)}, {len(dec.contexts)} and {len(dec.seconds)}")
    _check_points(where, [float(b) for b in dec.batches], dec.seconds)
    return LinearDecode.fit(dec.batches, dec.contexts, dec.seconds)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A hardware profile by name (services/paper/profiles/<name>.toml) or by path."""
    return _load_profile(_resolve(name_or_path), 0)


def load_model(name_or_path: str | Path = "hybrid_1t") -> ModelProfile:
    """The modeled model's KV-size profile; default: the paper's 1T hybrid."""
    spec = _read_spec(name_or_path, ModelSpec)
    _check_points(f"model {spec.name!r}", spec.kv_lengths, spec.kv_mib)
    fixed, per_token = polyfit(spec.kv_lengths, [m * MIB for m in spec.kv_mib], 1)
    points = tuple(zip(spec.kv_lengths, spec.kv_mib, strict=True))
    return ModelProfile(spec.name, spec.description, spec.sources, KVSize(fixed, per_token),
                        points, spec.source)


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """Modeled times and sizes of one instance of `profile` serving `model`."""

    profile: HardwareProfile
    model: ModelProfile = field(default_factory=load_model)

    @classmethod
    def load(cls, profile: str | Path, model: str | Path = "hybrid_1t") -> CostModel:
        return cls(load_profile(profile), load_model(model))

    def _prefill(self) -> QuadraticPrefill:
        if self.profile.prefill is None:
            raise ProfileError(f"profile {self.profile.name!r} has no prefill model")
        return self.profile.prefill

    def _decode(self) -> DecodeSpec:
        if self.profile.decode is None:
            raise ProfileError(f"profile {self.profile.name!r} has no decode model")
        return self.profile.decode

    def prefill_time_full(self, length: float) -> float:
        """T_prefill(l) of the paper: a whole prompt of `length` tokens, nothing cached."""
        return self._prefill()(length) if self.profile.paced else 0.0

    def prefill_time(self, l_new: int, l_cached: int = 0) -> float:
        """Seconds to prefill `l_new` tokens after `l_cached` cached ones: T(c+l) - T(c) + c0
        (QuadraticPrefill.extend: chunked from the cached boundary)."""
        _check_count("l_new", l_new)
        _check_count("l_cached", l_cached)
        if not self.profile.paced:
            return 0.0
        return self._prefill().extend(l_new, l_cached)

    def decode_step_time(self, batch: int, context: int) -> float:
        """Seconds for one decode step of `batch` sequences holding `context` tokens in all."""
        _check_count("batch", batch)
        _check_count("context", context)
        if not self.profile.paced or batch == 0:
            return 0.0
        if self.profile.decode_fit is not None:
            return self.profile.decode_fit(batch, context)
        return self._decode_fixed_s() + self._decode_read_s(batch, context)

    def _decode_read_s(self, batch: int, context: int) -> float:
        kv = self.model.kv
        read = batch * kv.fixed_bytes + context * kv.bytes_per_token
        return read / self._decode().hbm_bytes_per_s

    def _decode_fixed_s(self) -> float:
        spec = self._decode()
        anchor = self._decode_read_s(spec.bs_max, spec.bs_max * spec.reference_context)
        return spec.step_s - anchor

    def decode_slo(self) -> tuple[int, float]:
        """(BS_max, T_decode): the SLO-governed constants of paper Eq. 5."""
        spec = self._decode()
        return spec.bs_max, spec.step_s

    def kv_bytes(self, length: float) -> float:
        """S_kv(l): bytes of KV cache (all layers) for a request of `length` tokens."""
        return self.model.kv(length)

    def kv_throughput_bps(self, length: float) -> float:
        """Phi_kv(l) = S_kv(l) / T_prefill(l) in bits per second (paper Eq. 1)."""
        return 8.0 * self.kv_bytes(length) / self._prefill()(length)


class PacerStatistics(msgspec.Struct, frozen=True):
    jobs: int
    modeled_s: float
    target_s: float
    waited_s: float
    overruns: int
    worst_overrun_s: float


class Pacer:
    """How much longer a job must take so its wall time is modeled time * time_scale.

    time_scale 1 runs at the profile's speed; 10 runs ten times slower (a demo at human
    speed). When the real work already took longer ("overrun"), nothing is added.
    """

    def __init__(self, time_scale: float = 1.0) -> None:
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
        self.time_scale = time_scale
        self._jobs = self._overruns = 0
        self._modeled = self._target = self._waited = self._worst = 0.0

    def remaining(self, real_elapsed_s: float, modeled_s: float) -> float:
        """Seconds still to wait after `real_elapsed_s` of real work on a job of `modeled_s`."""
        for name, value in (("real_elapsed_s", real_elapsed_s), ("modeled_s", modeled_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        target = modeled_s * self.time_scale
        wait = max(0.0, target - real_elapsed_s)
        self._record(modeled_s, target, wait, real_elapsed_s - target)
        return wait

    def _record(self, modeled: float, target: float, wait: float, overrun: float) -> None:
        self._jobs += 1
        self._modeled += modeled
        self._target += target
        self._waited += wait
        if overrun > 0 and target > 0:
            self._overruns += 1
            self._worst = max(self._worst, overrun)

    def statistics(self) -> PacerStatistics:
        return PacerStatistics(self._jobs, self._modeled, self._target, self._waited,
                               self._overruns, self._worst)
