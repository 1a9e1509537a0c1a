"""The OpenAI requests: validation naming the parameter, normalisation, chat template."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.model.tokenizer import ByteTokenizer, Tokenizer, load_default
from services.router.errors import ContextTooLong, InvalidRequest, NotFound
from services.router.openai import ignored_warning
from services.router.openai_schema import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Limits,
    chat_generation,
    completion_generation,
    decode_request,
    render_chat,
    unknown_fields,
)

BPE: Tokenizer = load_default()
BYTES = ByteTokenizer()
LIMITS = Limits(max_context=64, models=("prfaas", "kimi-linear"))


def completion(**fields: object) -> CompletionRequest:
    return decode_request(msgspec.json.encode({"model": "prfaas", **fields}), CompletionRequest)


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "seed": "one"}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"usage": True}}, "stream_options.usage"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "!"}, "suffix"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": "7"}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
])
def test_bad_completion_fields_name_their_parameter(fields: dict[str, object],
                                                    param: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        completion(**fields)
    assert error.value.param == param and error.value.status == 400
    assert param.split(".")[0] in error.value.message


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user"}, None),
    ({"content": "x"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
     "messages[0].content[0].type"),
    ({"role": "user", "content": "x", "mood": "calm"}, "messages[0].mood"),
])
def test_bad_chat_messages_name_the_field(message: dict[str, object],
                                          param: str | None) -> None:
    body = msgspec.json.encode({"model": "prfaas", "messages": [message]})
    if param is None:
        request = decode_request(body, ChatCompletionRequest)
        assert request.messages[0].text() == ""
        return
    with pytest.raises(InvalidRequest) as error:
        decode_request(body, ChatCompletionRequest)
    assert error.value.param == param


def test_not_json_and_not_an_object() -> None:
    for body in (b"", b"{", b"[1]", b'"text"'):
        with pytest.raises(InvalidRequest):
            decode_request(body, CompletionRequest)


def test_completion_defaults_follow_openai_and_accept_token_prompts() -> None:
    generation = completion_generation(completion(prompt="Hello"), BPE, LIMITS)
    assert generation.prompt == BPE.encode("Hello")
    sampling = generation.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (16, 1.0, 1.0)
    assert sampling.stop_on_eos and not generation.stream and generation.stop == ()
    as_ids = completion_generation(completion(prompt=[[5, 6, 7]], max_tokens=3, seed=9,
                                              stop="x", ignore_eos=True), BPE, LIMITS)
    assert as_ids.prompt == [5, 6, 7] and as_ids.sampling.seed == 9
    assert as_ids.stop == ("x",) and not as_ids.sampling.stop_on_eos
    echoed = completion_generation(completion(prompt=["Hi there"], echo=True), BPE, LIMITS)
    assert echoed.echo_text == "Hi there"
    usage = completion_generation(completion(prompt="a", stream=True,
                                             stream_options={"include_usage": True}),
                                  BPE, LIMITS)
    assert usage.stream and usage.include_usage


def test_context_and_model_limits() -> None:
    with pytest.raises(ContextTooLong) as long:
        completion_generation(completion(prompt=list(range(1, 65))), BPE, LIMITS)
    assert (long.value.param, long.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(ContextTooLong) as room:
        completion_generation(completion(prompt=[1] * 60, max_tokens=5), BPE, LIMITS)
    assert room.value.param == "max_tokens"
    fits = completion_generation(completion(prompt=[1] * 60, max_tokens=4), BPE, LIMITS)
    assert fits.sampling.max_tokens == 4
    assert completion_generation(completion(prompt=[1] * 60), BPE, LIMITS).sampling.max_tokens \
        == 4
    with pytest.raises(NotFound) as model:
        completion_generation(decode_request(b'{"model": "gpt", "prompt": "x"}',
                                             CompletionRequest), BPE, LIMITS)
    assert (model.value.status, model.value.param) == (404, "model")
    with pytest.raises(InvalidRequest, match="token ids"):
        completion_generation(completion(prompt=[1, 99999]), BPE, LIMITS)


def test_chat_template_and_generation() -> None:
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}]),  # type: ignore[list-item]
                ChatMessage(role="assistant", content=" Hello."),
                ChatMessage(role="developer", content="Rule."),
                ChatMessage(role="tool", content="42")]
    messages[1] = msgspec.convert({"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                  ChatMessage)
    assert render_chat(messages) == ("System: Be brief.\nUser: Hi\nAssistant: Hello.\n"
                                     "System: Rule.\nTool: 42\nAssistant:")
    body = msgspec.json.encode({"model": "kimi-linear", "messages": [{"role": "user",
                                                                      "content": "Hi"}]})
    generation = chat_generation(decode_request(body, ChatCompletionRequest), BYTES, LIMITS)
    assert generation.prompt == BYTES.encode("User: Hi\nAssistant:")
    assert generation.sampling.max_tokens == 64 - len(generation.prompt)


@given(st.lists(st.tuples(st.sampled_from(["user", "system"]), st.text(max_size=20)),
                min_size=1, max_size=4), st.text(max_size=20), st.text(max_size=20))
def test_a_next_turn_extends_the_previous_prompt_and_its_answer(
        turns: list[tuple[str, str]], answer: str, new: str) -> None:
    messages = [ChatMessage(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]
    following = [*messages, ChatMessage(role="assistant", content=answer),
                 ChatMessage(role="user", content=new)]
    assert render_chat(following).startswith(render_chat(messages) + answer)


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "prfaas", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def test_unknown_top_level_fields_are_ignored_and_named() -> None:
    body = msgspec.json.encode({"model": "prfaas", "prompt": "x", "colour": "red",
                                "top_k": 5, "max_tokens": 2})
    request = decode_request(body, CompletionRequest)
    assert request.max_tokens == 2
    assert unknown_fields(body, CompletionRequest) == ["colour", "top_k"]
    assert unknown_fields(msgspec.json.encode({"model": "m", "messages": []}),
                          ChatCompletionRequest) == []
    assert ignored_warning(["colour", 'top"k']) == '299 - "ignored fields: colour, top\\"k"'
    assert ignored_warning(["a\u00e9"]) == '299 - "ignored fields: a?"'


def test_an_unknown_key_that_is_not_utf8_is_a_bad_request() -> None:
    # make chaos found it: the typed decode skips the key unread, the field check did not.
    body = b'{"model": "prfaas", "prompt": "x", "\xff": 1}'
    assert decode_request(body, CompletionRequest).prompt == "x"
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        unknown_fields(body, CompletionRequest)


def test_max_completion_tokens_is_max_tokens_on_both_endpoints() -> None:
    assert completion_generation(completion(prompt="a", max_completion_tokens=3), BPE,
                                 LIMITS).sampling.max_tokens == 3
    assert chat_generation(chat(max_completion_tokens=5), BPE, LIMITS).sampling.max_tokens == 5
    for request in (completion(prompt="a", max_tokens=2, max_completion_tokens=3),
                    chat(max_tokens=2, max_completion_tokens=3)):
        with pytest.raises(InvalidRequest) as both:
            if isinstance(request, CompletionRequest):
                completion_generation(request, BPE, LIMITS)
            else:
                chat_generation(request, BPE, LIMITS)
        assert both.value.param == "max_completion_tokens"


def test_n_choices_have_their_own_seeds_up_to_the_limit() -> None:
    generation = completion_generation(completion(prompt="a", n=3, seed=5), BPE, LIMITS)
    seeds = [choice.sampling.seed for choice in generation.choices()]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    assert all(-(1 << 63) <= s < 1 << 63 for s in seeds if s is not None)
    assert all(choice.n == 1 for choice in generation.choices())
    unseeded = completion_generation(completion(prompt="a", n=2), BPE, LIMITS).choices()
    assert [c.sampling.seed for c in unseeded] == [None, None]
    completion_generation(completion(prompt="a", n=MAX_CHOICES), BPE, LIMITS)
    with pytest.raises(InvalidRequest) as many:
        completion_generation(completion(prompt="a", n=MAX_CHOICES + 1), BPE, LIMITS)
    assert many.value.param == "n" and str(MAX_CHOICES) in many.value.message


def test_logprobs_reach_the_sampling_in_each_format() -> None:
    assert completion_generation(completion(prompt="a", logprobs=2), BPE,
                                 LIMITS).sampling.logprobs == 2
    assert completion_generation(completion(prompt="a"), BPE, LIMITS).sampling.logprobs is None
    assert chat_generation(chat(logprobs=True, top_logprobs=3), BPE,
                           LIMITS).sampling.logprobs == 3
    assert chat_generation(chat(logprobs=True), BPE, LIMITS).sampling.logprobs == 0
    assert chat_generation(chat(logprobs=False), BPE, LIMITS).sampling.logprobs is None
    with pytest.raises(InvalidRequest) as alone:
        chat_generation(chat(top_logprobs=2), BPE, LIMITS)
    assert alone.value.param == "top_logprobs"
    with pytest.raises(InvalidRequest):
        chat(logprobs=True, top_logprobs=21)


def test_min_tokens_stop_token_ids_and_continuous_usage() -> None:
    generation = completion_generation(completion(prompt="a", max_tokens=8, min_tokens=4,
                                                  stop_token_ids=[7, 9]), BPE, LIMITS)
    assert (generation.sampling.min_tokens, generation.sampling.stop_token_ids) == (4, (7, 9))
    with pytest.raises(InvalidRequest) as over:
        completion_generation(completion(prompt="a", max_tokens=3, min_tokens=4), BPE, LIMITS)
    assert over.value.param == "min_tokens"
    with pytest.raises(InvalidRequest) as vocab:
        completion_generation(completion(prompt="a", stop_token_ids=[BPE.vocab_size]), BPE,
                              LIMITS)
    assert vocab.value.param == "stop_token_ids"
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert completion_generation(completion(prompt="a", stream=True, stream_options=both),
                                 BPE, LIMITS).continuous_usage
    # As in vLLM, continuous usage needs include_usage.
    alone = {"continuous_usage_stats": True}
    assert not completion_generation(completion(prompt="a", stream=True, stream_options=alone),
                                     BPE, LIMITS).continuous_usage
