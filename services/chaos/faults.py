"""The faults: kill -9, SIGSTOP / SIGCONT and restarts (through the supervisor), the link
(its control API, and its Toxiproxy API for a partition), fuzzed mesh frames at a TCP port,
malformed bodies at the OpenAI API."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mesh.wire import PROTOCOL_VERSION, Abort, Call, Cast, End, Fail, Hello, Item, Open, Push, Reply
from services.chaos.load import Outcome, Result
from services.contract.messages import CODEC_MESSAGES

HEADER = struct.Struct(">I")


class Faults:
    """Fault actions against one running mesh (its URLs and admin token)."""

    def __init__(self, client: httpx.AsyncClient, supervisor: str, link: str,
                 headers: dict[str, str], api: str) -> None:
        self.client, self.supervisor, self.link, self.headers = client, supervisor, link, headers
        self.api = api

    async def _post(self, url: str, body: object = None) -> httpx.Response:
        response = await self.client.post(url, json=body if body is not None else {},
                                          headers=self.headers)
        response.raise_for_status()
        return response

    async def kill(self, name: str) -> None:
        await self._post(f"{self.supervisor}/processes/{name}/kill", {"signal": "KILL"})

    async def freeze(self, name: str) -> None:
        """SIGSTOP: the process stays alive and its connections open, but it answers nothing."""
        await self._post(f"{self.supervisor}/processes/{name}/kill", {"signal": "STOP"})

    async def wake(self, name: str) -> None:
        await self._post(f"{self.supervisor}/processes/{name}/kill", {"signal": "CONT"})

    async def partition(self) -> str:
        """The link cut (Toxiproxy's timeout toxic: an outage that holds the data in flight);
        returns the proxy's name, for `heal`."""
        response = await self.client.get(f"{self.link}/proxies", headers=self.headers)
        response.raise_for_status()
        proxy = next(iter(response.json()))
        await self._post(f"{self.link}/proxies/{proxy}/toxics",
                         {"name": "partition", "type": "timeout", "attributes": {"timeout": 0}})
        return str(proxy)

    async def heal(self, proxy: str) -> None:
        response = await self.client.delete(f"{self.link}/proxies/{proxy}/toxics/partition",
                                            headers=self.headers)
        response.raise_for_status()

    async def restart(self, name: str) -> None:
        await self._post(f"{self.supervisor}/processes/{name}/restart")

    async def link_state(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.link}/link", headers=self.headers)
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    async def link_update(self, **update: object) -> None:
        await self._post(f"{self.link}/link", update)

    async def link_reset(self) -> None:
        await self._post(f"{self.link}/reset")

    async def pin_threshold(self, t: float | None) -> None:
        """Pins the router's t (tokens), or clears the pin with None."""
        await self._post(f"{self.api}/admin/threshold", {"t": t})


# Fuzzed mesh frames.

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.binary(max_size=64))
WILD = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
IDS = st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1), WILD)


def _message(cls: type[msgspec.Struct], values: list[object]) -> msgspec.Struct:
    """A real contract message with wild field values: Struct.__init__ checks no types."""
    names = [field.name for field in msgspec.structs.fields(cls)]
    return cls(**dict(zip(names, values, strict=False)))


BODIES = st.one_of(WILD, st.builds(_message, st.sampled_from(CODEC_MESSAGES),
                                   st.lists(_SCALARS, min_size=40, max_size=40)))
ENVELOPES = st.one_of(
    st.builds(Hello, protocol=IDS, name=WILD),
    st.builds(Call, id=IDS, body=BODIES, timeout=WILD),
    st.builds(Cast, body=BODIES),
    st.builds(Reply, id=IDS, body=BODIES),
    st.builds(Fail, id=IDS, error=WILD, detail=WILD),
    st.builds(Open, id=IDS, body=BODIES),
    st.builds(Push, id=IDS, body=BODIES),
    st.builds(Item, id=IDS, body=BODIES),
    st.builds(End, id=IDS),
    st.builds(Abort, id=IDS, reason=WILD),
)


def envelope_frames(count: int, rng: random.Random, pool: int = 400) -> list[bytes]:
    """`count` framed envelopes of mesh.wire's types: `pool` built by hypothesis with wild
    values (generation costs about 10 ms each), the rest those with a few bytes flipped."""
    frames = _hypothesis_frames(min(count, pool))
    while len(frames) < count:
        frame = bytearray(rng.choice(frames[:pool]))
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(4, len(frame)) if len(frame) > 4 else 0] = rng.randrange(256)
        frames.append(bytes(frame))
    return frames


def _hypothesis_frames(count: int) -> list[bytes]:
    frames: list[bytes] = []

    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(ENVELOPES)
    def collect(envelope: object) -> None:
        try:
            body = msgspec.msgpack.encode(envelope)
        except (TypeError, OverflowError, ValueError):
            # A value msgpack cannot hold (e.g. an int past 64 bits): send its repr instead.
            body = msgspec.msgpack.encode(repr(envelope))
        frames.append(HEADER.pack(len(body)) + body)

    collect()
    return frames[:count]


def random_frames(rng: random.Random, count: int) -> list[bytes]:
    """Random bytes: unframed noise, honest lengths over noise, lies about the length."""
    frames: list[bytes] = []
    for _ in range(count):
        body = rng.randbytes(rng.randrange(0, 256))
        kind = rng.randrange(3)
        if kind == 0:
            frames.append(body)
        elif kind == 1:
            frames.append(HEADER.pack(len(body)) + body)
        else:
            frames.append(HEADER.pack(rng.choice([2**32 - 1, 2**31, 10**9, len(body) + 7]))
                          + body)
    return frames


def hello_frame(name: str) -> bytes:
    body = msgspec.msgpack.encode(Hello(protocol=PROTOCOL_VERSION, name=name))
    return HEADER.pack(len(body)) + body


async def fire_frames(port: int, frames: Sequence[bytes], rng: random.Random,
                      per_connection: int = 25, concurrency: int = 8) -> int:
    """Sends `frames` to 127.0.0.1:port over fresh connections (half of them after a valid
    Hello); returns how many connections the service refused or reset (expected)."""
    batches = [frames[i:i + per_connection] for i in range(0, len(frames), per_connection)]
    refused = 0
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(batch: Sequence[bytes], greet: bool) -> None:
        nonlocal refused
        async with limiter:
            try:
                with anyio.fail_after(10):
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        if greet:
                            await stream.send(hello_frame("chaos-fuzzer"))
                        for frame in batch:
                            await stream.send(frame)
                        with anyio.move_on_after(0.05):
                            await stream.receive()
            except (OSError, anyio.BrokenResourceError, anyio.EndOfStream, TimeoutError):
                refused += 1

    async with anyio.create_task_group() as tg:
        for batch in batches:
            tg.start_soon(one, batch, rng.random() < 0.5)
    return refused


# Malformed HTTP bodies.

def malformed_bodies(rng: random.Random, count: int) -> list[bytes]:
    """Bodies no API should accept, or should accept only after checking every field."""
    good = {"model": "prfaas", "prompt": "ROMEO:", "max_tokens": 4}
    fixed: list[bytes] = [
        b"", b"{", b"null", b"[]", b'"x"', b"{nope}", b"\xff\xfe\x00",
        b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
        msgspec.json.encode({**good, "max_tokens": -1}),
        msgspec.json.encode({**good, "max_tokens": 10**12}),
        msgspec.json.encode({**good, "prompt": 5}),
        msgspec.json.encode({**good, "seed": 2**70}),
        msgspec.json.encode({**good, "seed": -1}),
        msgspec.json.encode({**good, "temperature": "hot"}),
        msgspec.json.encode({**good, "stream": "yes"}),
        msgspec.json.encode({**good, "prompt": "x" * 100_000}),
        msgspec.json.encode({**good, "prompt": [[1, 2], [3]]}),
        msgspec.json.encode({**good, "n": 10**9}),
        msgspec.json.encode({**good, "model": None}),
        msgspec.json.encode({**good, "logit_bias": {"1": 1e308}}),
        msgspec.json.encode({**good, "stop": ["x"] * 10_000}),
        b'{"model": "prfaas", "prompt": "a", "max_tokens": 1e309}',
        b'{"model": "prfaas", "prompt": "\\ud800", "max_tokens": 4}',
        b'{"model": "prfaas", "messages": [{"role": "user", "content": null}]}',
    ]
    bodies = list(fixed)
    while len(bodies) < count:
        base = rng.choice(fixed[9:])
        kind = rng.randrange(3)
        if kind == 0:
            bodies.append(base[: rng.randrange(len(base) + 1)])
        elif kind == 1:
            flipped = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            bodies.append(bytes(flipped))
        else:
            bodies.append(rng.randbytes(rng.randrange(1, 512)))
    return bodies[:count]


async def send_raw(client: httpx.AsyncClient, path: str, content: bytes,
                   deadline_s: float) -> Result:
    """One POST of a raw body: completed (2xx), error (4xx/5xx), lost (no HTTP answer), hung."""
    sent = time.monotonic()
    with anyio.move_on_after(deadline_s):
        try:
            response = await client.post(path, content=content,
                                         headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return Result("lost", None, sent, None, time.monotonic(), repr(exc)[:200])
        now = time.monotonic()
        outcome: Outcome = "completed" if response.status_code < 400 else "error"
        return Result(outcome, response.status_code, sent, now, now, response.text[:120])
    return Result("hung", None, sent, None, time.monotonic(), "deadline passed")
