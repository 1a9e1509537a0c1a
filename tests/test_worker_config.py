"""A worker's options: typed from the topology (its cluster's under its own), the engines'
defaults kept, every key a worker does not read refused by name, and bad values named."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.topology import Topology, parse_topology
from services.contract.messages import DEFAULT_LANES
from services.worker.config import WorkerConfig, worker_config
from services.worker.decode import DecodeConfig
from services.worker.prefill import PrefillConfig

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("services/cli/topology.toml", "services/cli/topologies/two-prfaas.toml",
           "tests/multihost/topology.toml")


def topology(cluster: str = "", own: str = "") -> Topology:
    return parse_topology(f"""
[[clusters]]
name = "pd"
kind = "pd"
options = {{ {cluster} }}
[[services]]
name = "w"
kind = "prefill"
cluster = "pd"
port = 7001
options = {{ {own} }}
""")


def config(cluster: str = "", own: str = "") -> WorkerConfig:
    t = topology(cluster, own)
    return worker_config(t, t.service("w"))


def test_defaults_are_the_engines_own() -> None:
    c = config()
    assert c.prefill_config("w", "pd") == PrefillConfig(name="w", cluster="pd")
    assert c.decode_config("w", "pd") == DecodeConfig(name="w", cluster="pd")
    assert (c.connections, c.family, c.checkpoint, c.threads) == (
        DEFAULT_LANES, "kimi-linear", "auto", 0)


def test_a_services_own_options_win_over_its_clusters() -> None:
    c = config('family = "mimo", seed = 3, chunk_tokens = 128, max_batch = 20',
               "seed = 4, cache_mib = 64, slots = 2, metrics_port = 9100")
    assert (c.family, c.seed, c.cache_mib) == ("mimo", 4, 64.0)
    assert c.prefill_config("w", "pd").chunk_tokens == 128
    decode = c.decode_config("w", "pd")
    assert (decode.slots, decode.max_batch) == (2, 20)


@pytest.mark.parametrize(
    ("cluster", "own", "message"),
    [
        ("", "chunk_tokenz = 8", "service 'w': unknown worker option 'chunk_tokenz' "
         "(in its own options)"),
        ("batch = 8", "", "unknown worker option 'batch' (in cluster 'pd''s options)"),
        ("", 'seed = "x"', r"service 'w': bad worker option: Expected `int`, got `str` - at "
         r"`\$.seed`"),
        ("", "slots = 0", "slots must be >= 1, got 0"),
        ("", "connections = 0", "connections must be >= 1, got 0"),
        ("", "upload_slots = 0", "upload_slots must be >= 1, got 0"),
        ("scale = 0.0", "", "scale must be > 0, got 0.0"),
        ("", "chunk_tokens = -1", "chunk_tokens must be >= 0, got -1"),
        ("", "orphan_timeout = 0.0", "orphan_timeout must be > 0, got 0.0"),
    ],
)
def test_unknown_keys_and_bad_values_are_refused_by_name(cluster: str, own: str,
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(cluster, own)


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_topologys_workers_take_their_options(path: str) -> None:
    t = parse_topology((ROOT / path).read_text())
    workers = [s for s in t.services if s.kind in ("prefill", "decode")]
    assert workers
    for spec in workers:
        assert isinstance(worker_config(t, spec), WorkerConfig)
