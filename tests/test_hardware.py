"""Hardware profiles, their derivations from the paper, the cost model and the pacer."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.paper.hardware import (
    MIB,
    CostModel,
    Pacer,
    ProfileError,
    QuadraticPrefill,
    load_model,
    load_profile,
    polyfit,
)
from services.paper.workload import TruncatedLogNormal

TABLE5_LENGTHS = (1000, 8000, 32000, 128000)
TABLE5_SECONDS = (0.44, 0.72, 1.84, 7.40)
TABLE5_MIB = (190.8, 308.9, 701.3, 2316.3)
TABLE5_GBPS = (3.61, 3.59, 3.19, 2.62)


@pytest.fixture(scope="module")
def h200() -> CostModel:
    return CostModel.load("h200")


@pytest.fixture(scope="module")
def h20() -> CostModel:
    return CostModel.load("h20")


def test_h200_prefill_fit_at_table5_points(h200: CostModel) -> None:
    fitted = [h200.prefill_time_full(n) for n in TABLE5_LENGTHS]
    errors = [f / s - 1 for f, s in zip(fitted, TABLE5_SECONDS, strict=True)]
    # The documented fit errors: -2.0 %, +1.7 %, -0.2 %, +0.0 %.
    assert errors == pytest.approx([-0.0198, 0.0166, -0.0018, 0.0000], abs=5e-4)
    assert h200.profile.prefill_points == tuple(zip(TABLE5_LENGTHS, TABLE5_SECONDS, strict=True))


def test_polyfit_solves_the_normal_equations() -> None:
    xs, ys = TABLE5_LENGTHS, TABLE5_SECONDS
    coeffs = polyfit(xs, ys, 2)
    residuals = [y - sum(c * x**k for k, c in enumerate(coeffs)) for x, y in zip(xs, ys,
                                                                                 strict=True)]
    for k in range(3):
        column = [(x / 128000) ** k for x in xs]
        assert sum(r * c for r, c in zip(residuals, column, strict=True)) == pytest.approx(
            0.0, abs=1e-12)
    exact = polyfit([1, 2, 3, 7], [2 + 3 * x + 0.5 * x * x for x in (1, 2, 3, 7)], 2)
    assert exact == pytest.approx((2.0, 3.0, 0.5))
    with pytest.raises(ProfileError, match="degree=2"):
        polyfit([1, 2], [1, 2], 2)


def test_h20_prefill_is_derived_from_table6(h200: CostModel, h20: CostModel) -> None:
    workload = TruncatedLogNormal.paper()
    mean = workload.mean()
    l_short = workload.conditional_means(19400)[0]
    # Anchor lengths in h20.toml are the workload's mean and E[L | L <= 19.4K].
    (l1, _), (l2, _) = h20.profile.prefill_points
    assert (l1, l2) == pytest.approx((mean, l_short), abs=1.0)
    assert 9 / h20.prefill_time_full(mean) == pytest.approx(2.11, rel=1e-4)
    assert 3 / h20.prefill_time_full(l_short) == pytest.approx(1.64, rel=1e-4)
    h2, h1 = h20.profile.prefill, h200.profile.prefill
    assert h2 is not None and h1 is not None
    beta = h2.c2 / h1.c2
    assert beta == pytest.approx(3.081, abs=1e-3)
    assert h2.c1 / h1.c1 == pytest.approx(beta)
    assert h2.c0 == pytest.approx(0.4725, abs=1e-4)


def test_kv_size_fit_and_kv_throughput_match_table5(h200: CostModel) -> None:
    kv = h200.model.kv
    assert kv.fixed_bytes / MIB == pytest.approx(172.0, abs=0.1)
    assert kv.bytes_per_token == pytest.approx(17555, abs=1)
    for n, mib, gbps in zip(TABLE5_LENGTHS, TABLE5_MIB, TABLE5_GBPS, strict=True):
        assert h200.kv_bytes(n) / MIB == pytest.approx(mib, rel=0.012)
        assert h200.kv_throughput_bps(n) / 1e9 == pytest.approx(gbps, rel=0.03)


def test_decode_meets_the_slo_anchor(h20: CostModel) -> None:
    bs_max, step_s = h20.decode_slo()
    assert (bs_max, step_s) == (20, 0.025)
    # Eq. 5 per instance: 20 / (0.025 * 1024) = 0.78125 req/s, Table 6's 3.91 / 5.
    assert bs_max / (step_s * 1024) == pytest.approx(3.91 / 5, rel=2e-3)
    assert h20.decode_step_time(20, 20 * 28000) == pytest.approx(0.025, rel=1e-12)
    assert h20.decode_step_time(0, 0) == 0.0
    assert 0 < h20.decode_step_time(1, 1000) < h20.decode_step_time(20, 1000)
    assert h20.decode_step_time(20, 1000) < h20.decode_step_time(20, 10**6)


def test_incremental_prefill(h200: CostModel) -> None:
    t = h200.profile.prefill
    assert t is not None
    assert h200.prefill_time(30000) == pytest.approx(t(30000))
    assert h200.prefill_time(1000, 30000) == pytest.approx(t(31000) - t(30000) + t.c0)
    # Cheaper than recomputing the prefix, dearer after a longer prefix (attention).
    assert h200.prefill_time(1000, 30000) < h200.prefill_time(31000)
    assert h200.prefill_time(1000, 30000) > h200.prefill_time(1000, 0)
    with pytest.raises(ValueError, match="l_new"):
        h200.prefill_time(-1)


def test_cpu_profile_models_no_time() -> None:
    cpu = CostModel.load("cpu")
    assert not cpu.profile.paced
    assert cpu.prefill_time(5000, 100) == 0.0
    assert cpu.decode_step_time(8, 4000) == 0.0
    assert cpu.kv_bytes(1000) > 0


def test_profiles_name_their_sources() -> None:
    for name in ("h200", "h20", "cpu"):
        profile = load_profile(name)
        assert profile.name == name and profile.sources
    assert load_model().sources


def test_every_modeled_part_says_what_kind_of_source_it_has() -> None:
    # What the docs mark as reproduced by construction: H20 is fitted to Table 6.
    assert load_profile("h200").source_kinds() == {"prefill": "measured", "decode": "assumed"}
    assert load_profile("h20").source_kinds() == {"prefill": "fitted", "decode": "fitted"}
    assert load_profile("cpu").source_kinds() == {}
    assert load_model().source.kind == "measured"
    assert all(load_profile(n).decode.source.detail for n in ("h200", "h20"))  # type: ignore[union-attr]


def test_a_part_without_a_source_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ndescription = ""\ngpus_per_instance = 8\npaced = false\n'
                   'sources = []\n[prefill]\nfit = "quadratic"\n'
                   'lengths = [1, 2, 3]\nseconds = [1, 2, 3]\n')
    with pytest.raises(ProfileError, match="source"):
        load_profile(bad)
    bad.write_text(bad.read_text() + 'source = { kind = "guessed", detail = "" }\n')
    with pytest.raises(ProfileError, match="guessed"):
        load_profile(bad)


def test_profile_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no_such_chip"):
        load_profile("no_such_chip")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ndescription = ""\ngpus_per_instance = 8\npaced = true\n'
                   'sources = []\nflops = 3\n')
    with pytest.raises(ProfileError, match="flops"):
        load_profile(bad)
    bad.write_text('name = "x"\ndescription = ""\ngpus_per_instance = 8\npaced = true\n'
                   'sources = []\n')
    with pytest.raises(ProfileError, match="paced"):
        load_profile(bad)
    bad.write_text('name = "x"\ndescription = ""\ngpus_per_instance = 8\npaced = false\n'
                   'sources = []\n[prefill]\nfit = "affine_of"\nbase = "h200"\n'
                   'lengths = [1, 2, 3]\nseconds = [1, 2, 3]\n'
                   'source = { kind = "assumed", detail = "a test" }\n')
    with pytest.raises(ProfileError, match="2 anchors"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no prefill"):
        CostModel(load_profile("cpu")).kv_throughput_bps(100)


def test_quadratic_affine_is_pointwise() -> None:
    base = QuadraticPrefill(0.4, 4e-5, 1e-10)
    scaled = base.affine(-0.7, 3.0)
    for n in (0, 1000, 77777):
        assert scaled(n) == pytest.approx(-0.7 + 3.0 * base(n))


def test_pacer_waits_the_scaled_remainder() -> None:
    pacer = Pacer(time_scale=10.0)
    assert pacer.remaining(real_elapsed_s=0.5, modeled_s=0.2) == pytest.approx(1.5)
    assert pacer.remaining(real_elapsed_s=3.0, modeled_s=0.2) == 0.0
    assert pacer.remaining(real_elapsed_s=0.1, modeled_s=0.0) == 0.0
    stats = pacer.statistics()
    assert (stats.jobs, stats.overruns) == (3, 1)
    assert stats.modeled_s == pytest.approx(0.4)
    assert stats.target_s == pytest.approx(4.0)
    assert stats.waited_s == pytest.approx(1.5)
    assert stats.worst_overrun_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="time_scale"):
        Pacer(0.0)
    with pytest.raises(ValueError, match="modeled_s"):
        pacer.remaining(0.0, -1.0)


def test_a_linear_decode_fit_recovers_its_coefficients() -> None:
    from services.paper.hardware import LinearDecode

    truth = LinearDecode(0.012, 0.0009, 7e-7)
    points = [(b, c) for b in (1, 2, 4, 8, 16) for c in (128, 512, 1024)]
    fitted = LinearDecode.fit([b for b, _ in points], [c for _, c in points],
                              [truth(b, b * c) for b, c in points])
    for b, c in points:
        assert fitted(b, b * c) == pytest.approx(truth(b, b * c), rel=1e-9)
    with pytest.raises(ProfileError, match="3 paired points"):
        LinearDecode.fit([1, 2], [10, 10], [0.1, 0.2])


MEASURED = """name = "measured"
description = "a measured profile"
gpus_per_instance = 0
paced = true
sources = ["a test"]
[prefill]
fit = "quadratic"
lengths = [64.0, 256.0, 512.0, 1024.0]
seconds = [0.05, 0.16, 0.33, 0.75]
source = { kind = "measured", detail = "a test" }
chunk_tokens = 128
fit_error = 0.02
[decode]
bs_max = 8
step_s = 0.03
reference_context = 512
hbm_bytes_per_s = 0.0
source = { kind = "measured", detail = "a test" }
fit = "linear"
batches = [1, 8, 1, 8]
contexts = [128, 128, 1024, 1024]
seconds = [0.0130, 0.0200, 0.0136, 0.0249]
"""


def test_a_measured_decode_profile_times_steps_by_its_fit(tmp_path: Path) -> None:
    path = tmp_path / "measured.toml"
    path.write_text(MEASURED)
    cost = CostModel.load(path)
    fit = cost.profile.decode_fit
    assert fit is not None and cost.profile.source_kinds()["decode"] == "measured"
    # The step is the fit, not the HBM model (whose bandwidth is 0 here).
    assert cost.decode_step_time(8, 8 * 1024) == pytest.approx(fit(8, 8 * 1024))
    assert cost.decode_step_time(8, 8 * 1024) == pytest.approx(0.0249, rel=0.05)
    assert cost.decode_step_time(1, 128) < cost.decode_step_time(8, 1024) \
        < cost.decode_step_time(8, 8 * 1024)
    assert cost.decode_step_time(0, 0) == 0.0
    bad = tmp_path / "bad.toml"
    bad.write_text(MEASURED.replace("batches = [1, 8, 1, 8]", "batches = [1, 8, 1]"))
    with pytest.raises(ProfileError, match="pair up"):
        load_profile(bad)


def test_a_noisy_quadratic_prefill_fit_never_bends_below_zero() -> None:
    # Short prompts measured slow (noise, a warm-up): the plain fit's linear term goes
    # negative, so a chunk after a cached prefix would take negative time.
    lengths = [64.0, 128.0, 256.0, 512.0, 1024.0]
    seconds = [0.30, 0.12, 0.13, 0.25, 0.80]
    plain = polyfit(lengths, seconds, 2)
    assert min(plain) < 0.0
    fitted = QuadraticPrefill.fit(lengths, seconds)
    assert min(fitted.c0, fitted.c1, fitted.c2) >= 0.0
    for cached in (0, 64, 128, 512):
        for new in (1, 64, 128):
            assert fitted(cached + new) - fitted(cached) + fitted.c0 >= 0.0
    # Among non-negative quadratics it is the least-squares one: no small non-negative step
    # of any coefficient lowers the residual.
    def residual(c: tuple[float, float, float]) -> float:
        return sum((c[0] + c[1] * x + c[2] * x * x - y) ** 2
                   for x, y in zip(lengths, seconds, strict=True))
    best = (fitted.c0, fitted.c1, fitted.c2)
    for k, step in ((0, 1e-3), (1, 1e-6), (2, 1e-9)):
        for sign in (1.0, -1.0):
            moved = list(best)
            moved[k] = max(0.0, moved[k] + sign * step)
            assert residual(tuple(moved)) >= residual(best) - 1e-12  # type: ignore[arg-type]


def test_a_plain_fit_that_is_already_non_negative_is_kept_to_the_bit() -> None:
    lengths = [1024.0, 8192.0, 32768.0, 131072.0]
    seconds = [0.44, 0.72, 1.84, 7.40]
    c = polyfit(lengths, seconds, 2)
    assert min(c) >= 0.0
    fitted = QuadraticPrefill.fit(lengths, seconds)
    assert (fitted.c0, fitted.c1, fitted.c2) == c


def test_a_chunked_profile_is_fitted_with_its_per_chunk_cost() -> None:
    # A chunked engine pays each forward pass whole: 141 and 179 tokens (three chunks of 64)
    # cost about the same, 102 (two) a third less. The per-chunk term recovers it exactly.
    truth = QuadraticPrefill(0.01, 1e-5, 1e-8, 0.05, 64)
    lengths = [64.0, 102.0, 141.0, 179.0, 218.0, 256.0]
    fitted = QuadraticPrefill.fit(lengths, [truth(x) for x in lengths], 64)
    assert fitted.chunk == 64
    for got, want in ((fitted.c0, 0.01), (fitted.c1, 1e-5), (fitted.c2, 1e-8),
                      (fitted.per_chunk, 0.05)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    # Without the chunk the same points fit worse: the quadratic cannot step.
    plain = QuadraticPrefill.fit(lengths, [truth(x) for x in lengths])
    assert plain.per_chunk == 0.0
    assert max(abs(plain(x) / truth(x) - 1) for x in lengths) > 0.05


def test_the_chunk_term_stays_out_where_the_points_cannot_tell_it_apart() -> None:
    # Whole chunks only: the chunk count is a line in the length, so no chunk term.
    lengths = [64.0, 128.0, 192.0, 256.0, 320.0]
    fitted = QuadraticPrefill.fit(lengths, [0.02 + 0.001 * x for x in lengths], 64)
    assert fitted.per_chunk == 0.0 and fitted.chunk == 0


def test_a_suffix_after_a_cached_prefix_pays_its_own_chunks() -> None:
    t = QuadraticPrefill(0.01, 1e-5, 1e-8, 0.05, 64)
    # 70 new tokens after 1,000 cached: two chunks, the attention over the longer context.
    want = 0.01 + 1e-5 * 70 + 1e-8 * (1070**2 - 1000**2) + 2 * 0.05
    assert t.extend(70, 1000) == pytest.approx(want)
    assert t.extend(0, 1000) == pytest.approx(0.01)
    assert t.extend(64, 0) == pytest.approx(t(64))
    doubled = t.affine(0.0, 2.0)
    assert doubled(130) == pytest.approx(2 * t(130))
