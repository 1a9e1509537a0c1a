"""The SSE decoder and the reading of OpenAI streaming chunks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.bench.errors import BenchError
from services.bench.sse import ChunkInfo, SSEDecoder, SSEEvent, read_chunk

STREAM = (
    ": keep-alive comment\r\n"
    "data: {\"a\": 1}\r\n\r\n"
    "event: update\nid: 7\ndata: line one\ndata:line two\n\n"
    "data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"a": 1}'),
    SSEEvent("line one\nline two", "update", "7"),
    SSEEvent("[DONE]", "message", "7"),  # the last event id persists, as the spec says
]


def decode_in_pieces(text: str, cuts: list[int]) -> list[SSEEvent]:
    decoder, events, start = SSEDecoder(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += decoder.feed(text[start:cut])
        start = cut
    return events + decoder.close()


def test_whole_stream() -> None:
    assert decode_in_pieces(STREAM, []) == EXPECTED


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_of_the_stream_gives_the_same_events(cuts: list[int]) -> None:
    assert decode_in_pieces(STREAM, cuts) == EXPECTED


def test_cr_only_line_ends_and_crlf_split_across_chunks() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("data: x\r") == []
    assert decoder.feed("\n\r\n") == [SSEEvent("x")]
    assert decoder.feed("data: y\r\rdata: z\r\r") == [SSEEvent("y"), SSEEvent("z")]


def test_close_dispatches_a_final_event_without_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("data: tail") == []
    assert decoder.close() == [SSEEvent("tail")]
    assert decoder.close() == []


def chunk(**fields: object) -> str:
    return json.dumps(fields)


def test_completions_chat_usage_and_the_prfaas_field() -> None:
    assert read_chunk(chunk(choices=[{"text": "Hel", "index": 0}])).text == "Hel"
    chat = read_chunk(chunk(choices=[{"delta": {"content": "lo"}, "finish_reason": None}]))
    assert chat == ChunkInfo(text="lo")
    final = read_chunk(chunk(
        choices=[{"text": "", "finish_reason": "length"}],
        usage={"prompt_tokens": 700, "completion_tokens": 16,
               "prompt_tokens_details": {"cached_tokens": 512}},
        prfaas={"cluster": "prfaas", "cached_tokens": 640}))
    assert final == ChunkInfo(finish_reason="length", prompt_tokens=700, completion_tokens=16,
                              cached_tokens=640, cluster="prfaas")
    usage_only = read_chunk(chunk(choices=[], usage={
        "prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}))
    assert (usage_only.cached_tokens, usage_only.cluster) == (3, None)


def test_tolerates_missing_and_odd_fields() -> None:
    assert read_chunk("{}") == ChunkInfo()
    odd = read_chunk(chunk(choices=[{"delta": {"role": "assistant"}}], prfaas="pd",
                           usage={"completion_tokens": "many"}))
    assert odd == ChunkInfo()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not json", "stream chunk is not JSON: 'not json'"),
        ("[1, 2]", "stream chunk must be a JSON object"),
        ('{"error": {"message": "overloaded"}}', "server error in stream: .*overloaded"),
    ],
)
def test_bad_chunks_raise_naming_them(data: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        read_chunk(data)


def test_a_token_chunk_without_text_is_counted_and_role_finish_and_usage_chunks_are_not() -> None:
    chunks = {
        '{"choices":[{"index":0,"delta":{"content":""}}]}': True,
        '{"choices":[{"index":0,"text":""}]}': True,
        '{"choices":[{"index":0,"delta":{"content":"hi"}}]}': False,
        '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}': False,
        '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}': False,
        '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}': False,
    }
    assert {data: read_chunk(data).empty for data in chunks} == chunks
