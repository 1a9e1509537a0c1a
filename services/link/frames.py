"""How much link a mesh frame takes: its bytes, or the payload a sized KV piece stands for.

The simulation's KV pieces carry their modeled size (`KVChunk.nbytes`) instead of bytes; the
in-memory link (netem.memory) charges each frame `payload_weight(codec)(body)`, so the link is
exactly as busy as it would be with the bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from mesh.errors import MeshError
from mesh.wire import Codec
from services.contract.messages import KVChunk


def payload_weight(codec: Codec) -> Callable[[memoryview], int]:
    """Bytes a frame body occupies on the link: its length plus any modeled payload."""

    def weight(body: memoryview) -> int:
        try:
            message = getattr(codec.decode(body), "body", None)
        except MeshError:
            # Not a frame of ours: it costs what it is.
            return len(body)
        return len(body) + message.nbytes if isinstance(message, KVChunk) else len(body)

    return weight
