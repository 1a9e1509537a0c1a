"""The serving dtype: how it is chosen, and bfloat16 serving against the fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import services.model
from services.model import precision
from services.model.config import ModelConfigError, family_config
from services.model.generate import generate, prefill
from services.model.model import HybridLM, build_model
from services.model.precision import cpu_flags, resolve_dtype, serving_dtype
from services.model.tokenizer import load_default
from services.model.train import DEFAULT_CHECKPOINT, load_checkpoint

# A fixed text (not from the corpus, so the test does not depend on where the corpus lives).
TEXT = """KING RICHARD II:
Old John of Gaunt, time-honour'd Lancaster,
Hast thou, according to thy oath and band,
Brought hither Henry Hereford thy bold son,
Here to make good the boisterous late appeal,
Which then our leisure would not let us hear,
Against the Duke of Norfolk, Thomas Mowbray?

JOHN OF GAUNT:
I have, my liege.

KING RICHARD II:
Tell me, moreover, hast thou sounded him,
If he appeal the duke on ancient malice;
Or worthily, as a good subject should,
On some known ground of treachery in him?
"""


pytestmark = pytest.mark.usefixtures("one_thread")


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n\nflags : other\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx512f", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx512f", "avx512_bf16"}, torch.bfloat16), ({"amx_bf16"}, torch.bfloat16),
    ({"avx512f", "avx2"}, torch.float32), (set(), torch.float32),
])
def test_serving_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str],
                                       expected: torch.dtype) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    assert serving_dtype("cpu") == expected == services.model.serving_dtype()
    assert resolve_dtype("auto") == str(expected).removeprefix("torch.")
    assert build_model(family_config("dense", "tiny"), dtype="auto").dtype == expected
    # Explicit choices are honoured whatever the hardware; other devices fall back to fp32.
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    assert serving_dtype("meta") == torch.float32


def test_resolve_dtype_names_the_choices() -> None:
    with pytest.raises(ModelConfigError, match=r"auto.*float32.*bfloat16.*'float16'"):
        resolve_dtype("float16")


@pytest.fixture(scope="module")
def checkpoints() -> tuple[HybridLM, HybridLM]:
    if not DEFAULT_CHECKPOINT.is_file():
        pytest.skip("no shipped checkpoint")
    models = [load_checkpoint(dtype=d)[0] for d in ("float32", "bfloat16")]
    assert all(isinstance(m, HybridLM) for m in models)
    return models[0], models[1]  # type: ignore[return-value]


def test_bfloat16_serving_matches_float32_on_the_checkpoint(
        checkpoints: tuple[HybridLM, HybridLM]) -> None:
    """Teacher-forced over ~300 tokens: per-token loss within 0.02 nats, argmax equal at >= 97%
    of positions, logits within 0.25 (they span about +-15); greedy text equal for 24 tokens."""
    f32, b16 = checkpoints
    assert (f32.dtype, b16.dtype) == (torch.float32, torch.bfloat16)
    ids = torch.tensor(load_default().encode(TEXT))
    logits = [prefill(m, ids, all_logits=True).all_logits for m in (f32, b16)]
    assert logits[0] is not None and logits[1] is not None
    ref, half = logits[0], logits[1]
    assert half.dtype == torch.float32 and ref.abs().max() > 5.0
    nll = [-x[:-1].log_softmax(-1).gather(1, ids[1:, None]).mean() for x in (ref, half)]
    assert abs(float(nll[0] - nll[1])) < 0.02
    assert (ref.argmax(-1) == half.argmax(-1)).float().mean() >= 0.97
    torch.testing.assert_close(half, ref, atol=0.25, rtol=0)
    runs = [generate(m, ids[:80], 24, stop_on_eos=False).tokens for m in (f32, b16)]
    assert runs[0] == runs[1]
