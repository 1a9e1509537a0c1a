"""A member of the decode batch: one request's cache, its output, and its tokens' way out.

The batch loop (services.worker.decode) hands each step's token to `Member.deliver`; the task
that streams the request to its reader takes them, as lists of events, from the member's
mailbox (`tokens`) and sends each list as one `TokenChunk` (`token_chunk`). A request that
wants its text whole (`DecodeRequest.incremental` false: a non-streamed completion) has its
tokens after the first held until its finish, or until `HELD_TOKENS` are held: two messages
for a short answer instead of one per step, on the worker's side and on the reader's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from mesh.mailbox import Mailbox
from services.contract.messages import DecodeRequest, TokenChunk
from services.model.batch import TokenEvent
from services.model.cache import RequestCache
from services.model.sampling import SamplingParams

# A request that wants its tokens at the end gets them in chunks of at most this many events
# (a step's token each), so that a long generation never waits whole in one message.
HELD_TOKENS = 256


@dataclass
class Member:
    """One request in the batch: its cache, its output so far, the channel to its reader."""

    request: DecodeRequest
    cache: RequestCache
    first_token: int
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    error: str | None = None
    held: list[TokenEvent] = field(default_factory=list)
    # What the loop has handed out and the reader has not sent yet; its reader drains a
    # backlog without a trip through the event loop per item, so a burst leaves in one write.
    tokens: Mailbox[list[TokenEvent]] = field(default_factory=lambda: Mailbox(sys.maxsize))

    def deliver(self, event: TokenEvent) -> bool:
        """Hands a token to the reader, or holds it for a request that wants its tokens at
        the end (module docstring); False when the reader has gone."""
        held = self.held
        held.append(event)
        if (not self.request.incremental and event.finish_reason is None
                and len(held) < HELD_TOKENS):
            return True
        self.held = []
        return self.tokens.put_nowait(held)

    def end(self) -> None:
        """No more tokens: the reader sends what is queued, then ends."""
        self.tokens.end()

    def fail(self, error: str) -> None:
        self.error = error
        self.tokens.end()


def token_chunk(request_id: str, events: list[TokenEvent]) -> TokenChunk:
    """One chunk of consecutive token events (an event of `count` stands for its token
    repeated; its logprob, if any, is the one given for it)."""
    if len(events) == 1:
        event = events[0]
        tokens = [event.token] * event.count
        logprobs = None if event.logprob is None else [event.logprob]
    else:
        tokens = [event.token for event in events for _ in range(event.count)]
        given = [event.logprob for event in events if event.logprob is not None]
        logprobs = given or None
    return TokenChunk(request_id=request_id, tokens=tokens, index=events[0].index,
                      finish_reason=events[-1].finish_reason, logprobs=logprobs)
