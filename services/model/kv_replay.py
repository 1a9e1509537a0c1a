"""Decode from exported KV pieces in a fresh process: the decode half of a split request.

    python -m services.model.kv_replay JOBS_FILE RESULTS_FILE

JOBS_FILE holds a msgpack list of `ReplayJob` (model config, seed, dtype, the encoded KV
pieces, the first token drawn after prefill, sampling parameters); each job rebuilds the
model from (config, seed), imports the pieces, joins a `DecodeBatch` and decodes to the end.
RESULTS_FILE receives the msgpack list of `ReplayResult`. The tests use it to check that a
prefill in one process plus a decode in another equals one-process generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import torch

from services.model.batch import DecodeBatch
from services.model.config import ModelConfig
from services.model.export import import_cache
from services.model.model import build_model
from services.model.sampling import SamplingParams


class ReplayJob(msgspec.Struct, frozen=True):
    config: ModelConfig
    seed: int
    dtype: str
    pieces: list[bytes]
    first_token: int
    params: SamplingParams


class ReplayResult(msgspec.Struct, frozen=True):
    tokens: list[int]
    finish_reason: str
    cache_length: int


@torch.no_grad()
def run_job(job: ReplayJob) -> ReplayResult:
    """Import the job's pieces and decode until end-of-text or the token limit."""
    model = build_model(job.config, job.seed, job.dtype)
    cache = import_cache(job.config, job.pieces, job.dtype)
    batch = DecodeBatch(model, slots=1)
    batch.join("replay", cache, job.first_token, job.params)
    tokens = [job.first_token]
    while True:
        step = batch.step()
        tokens.append(step.events[0].token)
        reason = step.events[0].finish_reason
        if reason is not None:
            return ReplayResult(tokens, reason, step.finished["replay"].length)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m services.model.kv_replay JOBS_FILE RESULTS_FILE", file=sys.stderr)
        return 2
    jobs = msgspec.msgpack.decode(Path(argv[0]).read_bytes(), type=list[ReplayJob])
    results = [run_job(job) for job in jobs]
    Path(argv[1]).write_bytes(msgspec.msgpack.encode(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
