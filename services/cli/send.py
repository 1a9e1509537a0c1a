"""`prfaas send`: drive one prompt through a chosen prefill worker and decode worker.

The data path without the router's choices (docs/architecture.md section 4, steps 4-7): ask
the cache directory what the decode worker already holds of the prompt, then run the router's
own request driver (`services.router.runner.drive`): the token stream opened at the decode
worker beside the prefill call (the prefill worker streams the KV straight to the decode
worker); print the tokens as they arrive and the bytes moved.

    prfaas send "To be, or not to be" --prefill prfaas-prefill-0 --decode pd-decode-0

`drive_request` collects one such request's tokens and timings (tests use it too).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import httpx
import msgspec

from mesh.errors import ConfigError, MeshError
from mesh.node import Node
from mesh.topology import Topology, load_topology
from mesh.transport import TcpTransport
from mesh.wire import Codec
from services.cli.serve import DEFAULT_TOPOLOGY_PATH, TOPOLOGY_ENV
from services.contract.access import service_secret
from services.contract.errors import DataPathError
from services.contract.messages import (
    CODEC_MESSAGES,
    DecodeRequest,
    ModelInfo,
    PlanQuery,
    PlanReply,
    PrefillDone,
    PrefillRequest,
    StatusQuery,
    TokenChunk,
    WorkerState,
)
from services.contract.sampling import Sampling
from services.model.tokenizer import ByteTokenizer, TokenizerLike, load_default
from services.router.errors import RouterError
from services.router.runner import drive
from services.service import link_service_of
from services.worker.prefix_store import prompt_hashes

log = logging.getLogger(__name__)

# After a failed prefill call, how long the decode stream may take to say what went wrong.
FAILURE_GRACE_S = 5.0


class DriveResult(msgspec.Struct, frozen=True, kw_only=True):
    """One request, end to end: its tokens, the prefill's report and the client's timings."""

    request_id: str
    tokens: list[int]
    finish_reason: str | None
    decode_has_tokens: int  # what the plan said the decode worker held
    prefill: PrefillDone
    ttft_s: float
    e2e_s: float


async def decode_has_tokens(node: Node, cachedir: str, prompt: Sequence[int], decode_worker: str,
                            block_size: int, timeout: float = 10.0) -> int:
    """Tokens of `prompt` the decode worker holds, per the directory (block-aligned, and short
    of the whole prompt: at least one token is always computed)."""
    hashes = prompt_hashes(prompt, block_size)
    if not hashes:
        return 0
    reply = await node.call(cachedir, PlanQuery(hashes=hashes, target_worker=decode_worker),
                            PlanReply, timeout=timeout)
    limit = (len(prompt) - 1) // block_size
    return min(reply.plan.target_held, limit) * block_size


async def drive_request(
    node: Node,
    prompt: Sequence[int],
    *,
    prefill_worker: str,
    decode_worker: str,
    request_id: str,
    sampling: Sampling | None = None,
    decode_has: int = 0,
    connections: int = 1,
    overlap: bool = True,
    chunk_tokens: int | None = None,
    kv_timeout: float = 60.0,
    timeout: float = 300.0,
    incremental: bool = True,
    on_chunk: Callable[[TokenChunk], None] = lambda chunk: None,
) -> DriveResult:
    """One prompt through two named workers on the router's request driver
    (`services.router.runner.drive`), collecting its tokens and the client's timings.

    UpstreamFailed naming the worker on failure; when the prefill call fails, the decode
    stream is given `FAILURE_GRACE_S` to report its own, more specific error (a cut KV
    stream), which is then the one raised.
    """
    started = anyio.current_time()
    prompt = list(prompt)
    sampling = sampling or Sampling()
    decode = DecodeRequest(request_id=request_id, prompt=prompt, sampling=sampling,
                           kv_timeout=kv_timeout, incremental=incremental)
    prefill = PrefillRequest(request_id=request_id, prompt=prompt, decode_worker=decode_worker,
                             decode_has_tokens=decode_has, sampling=sampling,
                             connections=connections, overlap=overlap,
                             chunk_tokens=chunk_tokens)
    tokens: list[int] = []
    first_at: list[float] = []

    def take(chunk: TokenChunk) -> str | None:
        first_at[:] = first_at or [anyio.current_time()]
        tokens.extend(chunk.tokens)
        on_chunk(chunk)
        return chunk.finish_reason

    driven = await drive(node, prefill_worker, prefill, decode_worker, decode, timeout=timeout,
                         on_chunk=take, grace_s=FAILURE_GRACE_S)
    return DriveResult(request_id=request_id, tokens=tokens,
                       finish_reason=driven.finish_reason, decode_has_tokens=decode_has,
                       prefill=driven.prefill, ttft_s=(first_at or [started])[0] - started,
                       e2e_s=anyio.current_time() - started)


class LinkStatsError(MeshError):
    """A link's control API did not answer its byte counters."""


async def link_egress_bytes(topology: Topology, timeout: float = 5.0,
                            strict: bool = False) -> dict[str, int]:
    """Bytes each link has carried a -> b so far, read from its control API. A link that does
    not answer reads 0 (for `prfaas send`'s report), or raises LinkStatsError when `strict`
    (a measurement must not pass on a counter it could not read)."""
    out: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for link in topology.links:
            spec = link_service_of(topology, link)
            url = f"http://{spec.host}:{spec.options.get('control_port', 8474)}/link"
            try:
                response = await client.get(url)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                if strict:
                    raise LinkStatsError(f"link {link.name} statistics at {url}: {exc}") from exc
                log.warning("link %s statistics unavailable: %s", link.name, exc)
                out[link.name] = 0
                continue
            out[link.name] = int(response.json()["statistics"]["link"]["egress"]["bytes_out"])
    return out


def pick_tokenizer(info: ModelInfo) -> TokenizerLike:
    """The byte tokenizer for small-vocabulary test models, else the shipped BPE."""
    if info.vocab_size < 4096:
        return ByteTokenizer()
    return load_default()


def render(tokenizer: TokenizerLike, ids: Sequence[int]) -> str:
    """Text of `ids`; ids the tokenizer lacks (a test model's larger vocabulary) as [id]."""
    out: list[str] = []
    run: list[int] = []
    for token in [*ids, -1]:
        if 0 <= token < tokenizer.vocab_size:
            run.append(token)
            continue
        out.append(tokenizer.decode(run) if run else "")
        run = []
        out.append(f"[{token}]" if token >= 0 else "")
    return "".join(out)


class SendReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `prfaas send --json` prints last: the request and the bytes each link carried."""

    result: DriveResult
    prompt_tokens: int
    text: str
    link_bytes: dict[str, int]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas send", description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="?", default="", help="the prompt (see also --tokens)")
    parser.add_argument("--tokens", help="the prompt as comma-separated token ids instead")
    parser.add_argument("--prefill", default="prfaas-prefill-0", help="prefill worker")
    parser.add_argument("--decode", default="pd-decode-0", help="decode worker")
    parser.add_argument("--topology", type=Path,
                        help=f"topology TOML (default: ${TOPOLOGY_ENV}, else embedded)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--connections", type=int, default=1, help="TCP lanes for the KV")
    parser.add_argument("--no-plan", action="store_true",
                        help="do not ask the cache directory: send the whole KV")
    parser.add_argument("--request-id", default=f"send-{os.getpid()}")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    return parser.parse_args(argv)


async def _send(args: argparse.Namespace, topology: Topology) -> SendReport:
    node = Node(f"send-{os.getpid()}", Codec(CODEC_MESSAGES), TcpTransport(), topology.address,
                secret=service_secret(topology))
    async with node:
        state = await node.call(args.decode, StatusQuery(), WorkerState, timeout=args.timeout)
        tokenizer = pick_tokenizer(state.model)
        prompt = ([int(t) for t in args.tokens.split(",")] if args.tokens
                  else tokenizer.encode(args.text))
        has = 0
        cachedir = next((s.name for s in topology.find(kind="cachedir")), None)
        if cachedir and not args.no_plan:
            has = await decode_has_tokens(node, cachedir, prompt, args.decode,
                                          state.model.block_size)
        before = await link_egress_bytes(topology)
        sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature)

        def show(chunk: TokenChunk) -> None:
            if not args.json:
                print(render(tokenizer, chunk.tokens), end="", flush=True)

        result = await drive_request(
            node, prompt, prefill_worker=args.prefill, decode_worker=args.decode,
            request_id=args.request_id, sampling=sampling, decode_has=has,
            connections=args.connections, timeout=args.timeout, on_chunk=show)
        after = await link_egress_bytes(topology)
    moved = {name: after[name] - before.get(name, 0) for name in after}
    return SendReport(result=result, prompt_tokens=len(prompt),
                      text=render(tokenizer, result.tokens), link_bytes=moved)


def _summary(report: SendReport) -> str:
    r, p = report.result, report.result.prefill
    links = ", ".join(f"{k} {v} B" for k, v in report.link_bytes.items()) or "none"
    return (
        f"\n\n{len(r.tokens)} tokens ({r.finish_reason}); prompt {report.prompt_tokens} tokens, "
        f"decode worker held {r.decode_has_tokens}, prefill computed {p.computed_tokens} "
        f"(resumed {p.reused_tokens})\nKV {p.kv_bytes} B in {p.pieces} pieces over {p.lanes} "
        f"connection(s); link bytes: {links}\ncompute {p.compute_s:.3f} s, transfer after "
        f"compute {p.transfer_s:.3f} s, TTFT {r.ttft_s:.3f} s, end to end {r.e2e_s:.3f} s"
    )


def send_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING)
    try:
        # Like `prfaas serve`: the file `prfaas up --topology FILE` runs, when given none.
        path = args.topology or os.environ.get(TOPOLOGY_ENV) or None
        topology = load_topology(path, DEFAULT_TOPOLOGY_PATH.read_text("utf-8"))
        if not (args.text or args.tokens):
            raise ConfigError("give a prompt: TEXT or --tokens")
        report = anyio.run(_send, args, topology)
    except (MeshError, RouterError, DataPathError, ValueError) as exc:
        print(f"prfaas send: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(msgspec.json.encode(report).decode() if args.json else _summary(report))
    return 0
