"""The names every service shares, each defined once.

A worker's `Role` is what it serves; `WorkerRole` adds "draining" (finishing its work before a
role switch), as the router's table and the dashboard show it. `Cluster` is the kind of a
cluster as policies see it; clusters are named by plain strings in the topology. `Phase` is
where a request is in its life (queued, prefill, transfer, decode, then finished or failed).
`DEFAULT_TOKEN_SCALE` is the router's default tokens per paper token (its option `scale`): the
dashboard divides a served length by it to show the paper length it stands for.
"""

from __future__ import annotations

from typing import Final, Literal

Role = Literal["prefill", "decode"]
WorkerRole = Literal["prefill", "decode", "draining"]
Cluster = Literal["prfaas", "pd"]
Phase = Literal["queued", "prefill", "transfer", "decode", "finished", "failed"]

# The small model serves 1/32 of the paper's lengths: a prompt of L paper tokens is L / 32 served.
DEFAULT_TOKEN_SCALE: Final = 1 / 32
