"""Ping and Pong: the request and the reply the mesh's tests send each other (not a test
module)."""

from __future__ import annotations

import msgspec


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


class Pong(msgspec.Struct, frozen=True, tag=True):
    n: int
