"""`prfaas profile`: the fits, the TOML it writes (read back by the simulation's loaders)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.cli.main import main
from services.cli.profile import fit, profile_main, profile_toml
from services.paper.hardware import CostModel, load_model, load_profile
from services.worker.profiler import DecodePoint, PrefillPoint


def quadratic(length: float) -> float:
    return 0.02 + 5e-4 * length + 2e-7 * length * length


def step(batch: int, context: int) -> float:
    return 0.013 + 9e-4 * batch + 7e-7 * context


PREFILL = [PrefillPoint(n, 128, quadratic(n), 0.01) for n in (64, 256, 512, 1024)] + [
    PrefillPoint(n, 0, 0.8 * quadratic(n), 0.01) for n in (64, 1024)]
DECODE = [DecodePoint(b, c, step(b, b * c), 0.02) for b in (1, 4, 16) for c in (128, 1024)]


def test_the_fits_recover_what_was_measured() -> None:
    fits = fit(PREFILL, DECODE, 128)
    assert (fits.prefill.c0, fits.prefill.c1, fits.prefill.c2) == pytest.approx(
        (0.02, 5e-4, 2e-7), rel=1e-6)
    assert max(map(abs, fits.prefill_errors)) < 1e-9
    assert max(map(abs, fits.decode_errors)) < 1e-9
    # Only the chosen chunk size is fitted (four points, not six).
    assert len(fits.prefill_errors) == 4


def test_the_profile_reads_back_as_the_simulation_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "here.toml"
    noisy = [*PREFILL[:3], PrefillPoint(1024, 128, 1.1 * quadratic(1024), 0.01)]
    path.write_text(profile_toml("here", "a test host", noisy, DECODE, 128))
    cost = CostModel.load(path)
    profile = cost.profile
    assert profile.name == "here" and profile.paced
    assert profile.source_kinds() == {"prefill": "measured", "decode": "measured"}
    assert cost.prefill_time(300) == pytest.approx(quadratic(300), rel=0.1)
    assert cost.decode_step_time(4, 4 * 512) == pytest.approx(step(4, 4 * 512), rel=1e-4)
    assert cost.decode_slo()[0] == 16
    assert profile.decode is not None and profile.decode.fit_error < 1e-4
    spec_text = path.read_text()
    # The noisy point shows in the fit's error, written beside the points.
    error = float(spec_text.split("fit_error = ")[1].split()[0])
    assert 0.01 < error < 0.1
    assert "chunk_tokens = 128" in spec_text and "a test host" in spec_text


@pytest.mark.slow
def test_the_command_writes_a_profile_and_the_model_beside_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               ) -> None:
    out = tmp_path / "tiny-here.toml"
    threads = torch.get_num_threads()  # the command sets it: keep the test process's own
    code = profile_main(["--out", str(out), "--family", "kimi-linear", "--size", "tiny",
                         "--checkpoint", "none", "--lengths", "64,128,256",
                         "--chunk-tokens", "64", "--batches", "1,2,4", "--contexts", "32,96",
                         "--repeats", "1", "--no-progress", "--threads", str(threads)])
    assert code == 0
    cost = CostModel.load(out, tmp_path / "kimi-linear-tiny.toml")
    assert cost.prefill_time(128) > 0 and cost.decode_step_time(2, 100) > 0
    assert load_profile(out).source_kinds()["prefill"] == "measured"
    assert load_model(tmp_path / "kimi-linear-tiny.toml").kv(1024) > 0
    assert "Prefill at chunk 64" in capsys.readouterr().out


def test_help_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["profile", "--help"])
    assert done.value.code == 0
    assert "--chunk-tokens" in capsys.readouterr().out
    assert profile_main(["--device", "cuda"]) == 2
    assert profile_main(["--repeats", "0"]) == 2
