"""Server-sent events: one browser's feed as a `text/event-stream` body.

Each message carries a batch of events as one JSON object
`{"first": seq, "dropped": n, "events": [...]}`: during a burst a browser gets a few large
messages instead of hundreds of small ones, which is what keeps its main thread free. A
`reset` event tells the page to refetch its snapshot (a replay started or stopped). Comments
(`: heartbeat`) keep idle connections open through proxies. The stream opens with `hello`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio

from ui.hub import EventHub, FeedBatch

RETRY = b"retry: 2000\n\n"  # the browser reconnects after two seconds if the stream breaks
HEARTBEAT = b": heartbeat\n\n"
RESET = b"event: reset\ndata: {}\n\n"


def hello(seq: int) -> bytes:
    """The first message: the feed holds every event after `seq`, so the page may now fetch
    its snapshot (whose seq is at least this) and drop the buffered events it already covers."""
    return b'event: hello\ndata: {"seq":%d}\n\n' % seq


def encode_batch(batch: FeedBatch) -> bytes:
    """The SSE message(s) for one batch (our JSON has no newlines, so one data line each)."""
    parts = [RESET] if batch.reset else []
    if batch.events:
        head = b'data: {"first":%d,"dropped":%d,"events":[' % (batch.first_seq, batch.dropped)
        parts.append(head + b",".join(batch.events) + b"]}\n\n")
    return b"".join(parts)


async def event_stream(hub: EventHub) -> AsyncGenerator[bytes, None]:
    """The body of GET /events: runs until the hub closes or the browser goes away."""
    config = hub.config
    with hub.subscribe() as feed:
        yield RETRY + hello(hub.seq)
        while True:
            with anyio.move_on_after(config.heartbeat_s):
                await feed.wait()
            if not feed.ready:
                yield HEARTBEAT
                continue
            if config.batch_window_s > 0 and not feed.closed:
                # Let a burst gather: one message of many events is cheaper than many of one.
                await anyio.sleep(config.batch_window_s)
            batch = feed.take(config.max_batch)
            if batch is None:
                return
            yield encode_batch(batch)
