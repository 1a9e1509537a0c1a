"""TextAssembler equals its slow reference: UTF-8 held until complete, cut at stop strings."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.model.tokenizer import ByteTokenizer, Tokenizer, load_default
from services.router.text import TextAssembler, assemble_reference

BPE: Tokenizer = load_default()
BYTES = ByteTokenizer()


STOPS = st.lists(st.text(alphabet="abc é\n", min_size=1, max_size=3), max_size=3)


@given(st.lists(st.integers(0, BPE.vocab_size - 1), max_size=40),
       st.lists(st.integers(1, 5), min_size=1, max_size=40), STOPS)
def test_text_assembler_equals_decoding_everything_then_cutting(
        ids: list[int], steps: list[int], stops: list[str]) -> None:
    check_assembler(BPE, ids, steps, stops)


@given(st.lists(st.integers(1, 256), max_size=40),
       st.lists(st.integers(1, 3), min_size=1, max_size=40), STOPS)
def test_text_assembler_holds_back_split_utf8(ids: list[int], steps: list[int],
                                              stops: list[str]) -> None:
    check_assembler(BYTES, ids, steps, stops)


def check_assembler(tokenizer: Tokenizer | ByteTokenizer, ids: list[int], steps: list[int],
                    stops: list[str]) -> None:
    assembler = TextAssembler(tokenizer, stops)
    pieces, position, step = [], 0, 0
    while position < len(ids) and not assembler.stopped:
        size = steps[step % len(steps)]
        pieces.append(assembler.push(ids[position:position + size]))
        position, step = position + size, step + 1
    pieces.append(assembler.finish())
    # A character split across pushes and emitted early as U+FFFD would differ from the
    # reference, which decodes all ids at once (invalid bytes become U+FFFD in both).
    text, stopped = assemble_reference(tokenizer, ids, stops)
    assert "".join(pieces) == text and assembler.stopped == stopped


def test_utf8_split_across_tokens_is_held_until_complete() -> None:
    ids = BYTES.encode("é!")  # two bytes for é, then "!"
    assembler = TextAssembler(BYTES)
    assert assembler.push(ids[:1]) == ""
    assert assembler.push(ids[1:2]) == "é"
    assert assembler.push(ids[2:]) == "!"
    stop = TextAssembler(BYTES, ["lo w"])
    out = [stop.push(BYTES.encode(c)) for c in "hello world"]
    assert "".join(out) == "hel" and stop.stopped and stop.tokens == 7
