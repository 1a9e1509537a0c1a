"""The OpenAI request schema and its validation into the router's own request
(`GenerationRequest`, services/router/requests.py).

Requests are decoded straight into frozen msgspec Structs; anything the Structs refuse (a
wrong type, a value out of range, an unknown field inside a known one) becomes a 400
`InvalidRequest` that names the parameter, as the OpenAI API does. Unknown top-level fields
(other vendors' extensions) are ignored: `unknown_fields` names them for the `Warning` header.
`completion_generation` and `chat_generation` then tokenize the prompt and check it against
the model's context, giving the scheduler a `GenerationRequest` (vLLM's extensions
ignore_eos, min_tokens and stop_token_ids included).

Chat prompt template (a flat prompt for a small base model; `render_chat`):

    System: {content}\\n        (role "system" or "developer")
    User: {content}\\n
    Assistant:{content}\\n      (no space: the answer continues right after the colon)
    Tool: {content}\\n
    Assistant:                  (the generation prompt, no trailing space)

An assistant turn is rendered exactly where its generation began, so the next turn's prompt
is the previous prompt, then its answer, then the new messages: the prefix cache sees
multi-turn chat as incremental prefill (only the new text's KV is computed and sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, TypeVar

import msgspec

from services.contract.sampling import Sampling
from services.model.tokenizer import TokenizerLike
from services.router.errors import ContextTooLong, InvalidRequest, NotFound
from services.router.requests import GenerationRequest

MAX_STOPS = 4  # the OpenAI API's own limit on `stop`
MAX_CHOICES = 8  # `n`: each choice is a generation of its own
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (the OpenAI API's limit; completions allow 5)

MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOPS)] | None
# The mesh carries seeds as msgpack integers; OpenAI documents an int64 seed.
Seed = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
# "text", ["text"], [ids...] or [[ids...]]: typed to two levels, so that no body, however
# deeply nested, makes the decoder recurse past them (a 400 at the first level too deep).
Prompt = str | list[int | str | list[int]]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension: with include_usage, usage on every chunk too
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters both endpoints share (unsupported ones accept only their neutral value)."""

    model: str
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's extensions: no end-of-text or stop before min_tokens; token ids that stop
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: Prompt
    echo: bool = False
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    suffix: None = None


class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Literal["text"]] | None = None


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What the served model allows (tokens): context = prompt + generated tokens."""

    max_context: int = 8192
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # chat without max_tokens: at most this, within the context
    models: tuple[str, ...] = ("prfaas",)


RequestBody = TypeVar("RequestBody", CompletionRequest, ChatCompletionRequest)
_PARAM_PREFIX = "- at `$."


def _param_of(error: str) -> str | None:
    """The parameter a msgspec ValidationError message points at ("$.a.b[0]" -> "a.b[0]")."""
    where = error.split(_PARAM_PREFIX, 1)[1].rstrip("`") if _PARAM_PREFIX in error else ""
    for marker in ("unknown field `", "missing required field `"):
        if marker in error:
            name = error.split(marker, 1)[1].split("`", 1)[0]
            return f"{where}.{name}" if where else name
    return where or None


def decode_request(body: bytes, kind: type[RequestBody]) -> RequestBody:
    """The request in a JSON body; InvalidRequest naming the parameter when it is not one."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        param = _param_of(str(exc))
        where = f" (parameter {param!r})" if param else ""
        raise InvalidRequest(f"invalid request{where}: {exc}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        # Typed fields stop deep nesting early; this is the edge's last word on the rest.
        raise InvalidRequest("request body nests JSON too deeply") from exc


def unknown_fields(body: bytes, kind: type[RequestBody]) -> list[str]:
    """The top-level fields of a decoded request's body that `kind` does not know (ignored).

    The typed decode skips unknown keys unread, so a key that is not UTF-8 shows here first:
    a 400, as any other body that is not JSON."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    return [name for name in fields if name not in kind.__struct_fields__]


def _prompt_tokens(prompt: Prompt | list[int], tokenizer: TokenizerLike,
                   nested: bool = False) -> tuple[list[int], str]:
    """A single prompt as token ids, and its text ("" when given as ids).

    Accepted: "text", ["text"], [ids...], [[ids...]]; a batch of several prompts is not.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list) and not nested:
        return _prompt_tokens(prompt[0], tokenizer, nested=True)
    ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
    if prompt and len(ids) == len(prompt):
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must lie in [0, {tokenizer.vocab_size}), "
                                 f"got {bad[0]}", param="prompt")
        return ids, ""
    raise InvalidRequest("prompt must be one string or one list of token ids (batches of "
                         f"prompts are not supported), got {str(prompt)[:80]!r}", param="prompt")


def _check_unsupported(request: _Common) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) != 0.0:
            raise InvalidRequest(f"{name} is not supported, got {getattr(request, name)!r}; "
                                 "use 0", param=name)
    if request.logit_bias:
        raise InvalidRequest("logit_bias is not supported; omit it", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true",
                             param="stream_options")
    if request.stop is not None and any(not s for s in _stops(request.stop)):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    if request.n > MAX_CHOICES:
        raise InvalidRequest(f"n={request.n} is more choices than this server generates per "
                             f"request (at most {MAX_CHOICES})", param="n")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both",
                             param="max_completion_tokens")


def _check_token_ids(request: _Common, tokenizer: TokenizerLike, max_tokens: int) -> None:
    bad = [t for t in request.stop_token_ids or () if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must lie in [0, {tokenizer.vocab_size}), got "
                             f"{bad[0]}", param="stop_token_ids")
    if request.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens={request.min_tokens} exceeds the request's "
                             f"max_tokens={max_tokens}", param="min_tokens")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_model(model: str, limits: Limits) -> None:
    if model not in limits.models:
        raise NotFound(f"model {model!r} does not exist; served: {', '.join(limits.models)}",
                       param="model", code="model_not_found")


def _max_tokens(asked: int | None, prompt_len: int, limits: Limits, default: int,
                prompt_param: str) -> int:
    room = limits.max_context - prompt_len
    if room < 1:
        raise ContextTooLong(f"prompt has {prompt_len} tokens; this model's context is "
                             f"{limits.max_context} tokens (prompt + output)",
                             param=prompt_param, code="context_length_exceeded")
    if asked is None:
        return min(default, room)
    if asked > room:
        raise ContextTooLong(f"max_tokens={asked} plus the prompt's {prompt_len} tokens exceeds "
                             f"this model's context of {limits.max_context} tokens",
                             param="max_tokens", code="context_length_exceeded")
    return asked


def _generation(request: _Common, prompt: list[int], max_tokens: int,
                logprobs: int | None, echo_text: str = "") -> GenerationRequest:
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed, stop_on_eos=not request.ignore_eos, logprobs=logprobs,
        min_tokens=request.min_tokens, stop_token_ids=tuple(request.stop_token_ids or ()))
    options = request.stream_options
    usage = options is not None and options.include_usage
    return GenerationRequest(
        prompt=prompt, sampling=sampling, stop=_stops(request.stop), stream=request.stream,
        include_usage=usage, continuous_usage=usage and options is not None
        and options.continuous_usage_stats, model=request.model, echo_text=echo_text,
        n=request.n)


def _asked_max_tokens(request: _Common) -> int | None:
    return request.max_completion_tokens or request.max_tokens


def completion_generation(request: CompletionRequest, tokenizer: TokenizerLike,
                          limits: Limits) -> GenerationRequest:
    _check_model(request.model, limits)
    _check_unsupported(request)
    prompt, text = _prompt_tokens(request.prompt, tokenizer)
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if request.echo and not text:
        text = tokenizer.decode(prompt)
    max_tokens = _max_tokens(_asked_max_tokens(request), len(prompt), limits,
                             limits.default_max_tokens, "prompt")
    _check_token_ids(request, tokenizer, max_tokens)
    return _generation(request, prompt, max_tokens, request.logprobs,
                       text if request.echo else "")


_CHAT_NAMES = {"system": "System", "developer": "System", "user": "User",
               "assistant": "Assistant", "tool": "Tool"}


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The flat prompt of a conversation (template in the module docstring)."""
    lines = []
    for message in messages:
        name = _CHAT_NAMES[message.role]
        gap = "" if message.role == "assistant" else " "
        lines.append(f"{name}:{gap}{message.text()}\n")
    return "".join(lines) + "Assistant:"


def chat_generation(request: ChatCompletionRequest, tokenizer: TokenizerLike,
                    limits: Limits) -> GenerationRequest:
    _check_model(request.model, limits)
    _check_unsupported(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = tokenizer.encode(render_chat(request.messages))
    max_tokens = _max_tokens(_asked_max_tokens(request), len(prompt), limits,
                             limits.chat_max_tokens, "messages")
    _check_token_ids(request, tokenizer, max_tokens)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _generation(request, prompt, max_tokens, logprobs)
