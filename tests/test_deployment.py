"""Deployments of equal hardware (services/cli/deployment.py) and the topologies the policy
comparison (benchmarks/compare_policies.py) generates from them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from benchmarks.compare_policies import mesh_topology
from mesh.errors import ConfigError
from mesh.topology import Topology, load_topology, parse_topology
from services.bench.comparison import format_comparison
from services.cli.deployment import (
    deploy,
    shape_of,
    topology_text,
    workers,
)
from services.cli.serve import DEFAULT_TOPOLOGY_PATH, default_topology
from services.paper.case_study import DEPLOYMENTS, deployment_for
from services.service import link_routes

TWO_PRFAAS = DEFAULT_TOPOLOGY_PATH.parent / "topologies" / "two-prfaas.toml"


def _load(path: Path) -> Topology:
    return load_topology(path, "")


def _hardware(topology: Topology) -> Counter[str]:
    """Every worker's profile, whatever its role or cluster."""
    return Counter(str(topology.options_of(s)["profile"]) for s in workers(topology))


@pytest.mark.parametrize("path", [DEFAULT_TOPOLOGY_PATH, TWO_PRFAAS])
def test_every_deployment_has_the_same_workers_and_hardware(path: Path) -> None:
    base = _load(path)
    for deployment in DEPLOYMENTS:
        drawn = deploy(base, deployment)
        assert len(workers(drawn)) == len(workers(base)), deployment
        assert _hardware(drawn) == _hardware(base), deployment
        assert sum(shape_of(drawn).counts) == len(workers(base)), deployment
        # What the comparison writes to a file and runs: it reads back as the same topology.
        assert parse_topology(topology_text(drawn)) == drawn


def test_the_default_topology_shapes() -> None:
    base = default_topology()
    shapes = {d: shape_of(deploy(base, d)) for d in DEPLOYMENTS}
    assert {d: s.text() for d, s in shapes.items()} == {
        "prfaas-pd": "1 / 2 / 2", "homogeneous": "- / 3 / 2", "naive": "1 / - / 4"}
    assert shapes["homogeneous"].stages() == {
        "prfaas": "-", "pd_prefill": "2 x h20 + 1 x h200", "pd_decode": "2 x h20"}
    assert shapes["naive"].stages()["pd_decode"] == "4 x h20"


@pytest.mark.parametrize("path", [DEFAULT_TOPOLOGY_PATH, TWO_PRFAAS])
def test_homogeneous_moves_each_prfaas_worker_into_pd_as_it_was(path: Path) -> None:
    base = _load(path)
    drawn = deploy(base, "homogeneous")
    before = [s for s in workers(base) if base.cluster_kind(s) == "prfaas"]
    after = {s.port: s for s in workers(drawn)}
    assert before and not [s for s in workers(drawn) if drawn.cluster_kind(s) == "prfaas"]
    for old in before:
        new = after[old.port]
        assert (new.kind, drawn.cluster_kind(new)) == ("prefill", "pd")
        # Same hardware profile and every other option: only the cluster changed.
        assert drawn.options_of(new) == base.options_of(old)
        assert drawn.options_of(new)["profile"] == "h200"
    n_p = shape_of(base).counts[1]
    assert shape_of(drawn).counts == (0, n_p + len(before), shape_of(base).counts[2])
    assert drawn.links == base.links


@pytest.mark.parametrize("path", [DEFAULT_TOPOLOGY_PATH, TWO_PRFAAS])
def test_naive_turns_every_pd_prefill_worker_into_a_decode_worker(path: Path) -> None:
    base = _load(path)
    drawn = deploy(base, "naive")
    n_prfaas, n_p, n_d = shape_of(base).counts
    assert n_p > 0 and shape_of(drawn).counts == (n_prfaas, 0, n_p + n_d)
    for old in (s for s in workers(base) if s.kind == "prefill" and s.cluster == "pd"):
        new = next(s for s in workers(drawn) if s.port == old.port)
        assert (new.kind, new.cluster, new.options) == ("decode", "pd", old.options)


def test_an_unknown_deployment_is_refused() -> None:
    with pytest.raises(ConfigError, match="deployment must be one of"):
        deploy(default_topology(), "all-decode")


@pytest.mark.parametrize(("policy", "deployment", "shape"), [
    ("homogeneous", "homogeneous", "- / 3 / 2"), ("naive-hetero", "naive", "1 / - / 4"),
    ("prfaas-dynamic", "prfaas-pd", "1 / 2 / 2"), ("prfaas", "prfaas-pd", "1 / 2 / 2"),
])
def test_the_comparison_runs_each_policy_on_its_deployment(policy: str, deployment: str,
                                                            shape: str) -> None:
    assert deployment_for(policy) == deployment
    plan = mesh_topology(policy, 1 / 64)
    assert (plan.deployment, plan.shape.text()) == (deployment, shape)
    assert parse_topology(plan.text) == plan.topology
    router = plan.topology.service("router")
    assert (router.options["policy"], router.options["scale"]) == (policy, 1 / 64)
    assert {c.options["scale"] for c in plan.topology.clusters} == {1 / 64}
    assert set(plan.ports.metrics) == {s.name for s in workers(plan.topology)}


def test_the_comparison_gives_every_port_once() -> None:
    """Services, their option ports and each link's proxy routes (both ways) never share."""
    plan = mesh_topology("prfaas-dynamic", 1 / 64)
    topology = plan.topology
    ports = [s.port for s in topology.services]
    # proxy_base_port is the first route's port, counted with the routes
    ports += [int(v) for s in topology.services for k, v in s.options.items()
              if k.endswith("_port") and k != "proxy_base_port"]
    ports += [r.listen.port for link in topology.links for r in link_routes(topology, link)]
    assert len(ports) == len(set(ports))


def test_the_printed_table_states_each_shape_even_for_a_failed_run() -> None:
    results = {}
    for policy in ("homogeneous", "naive-hetero"):
        shape = shape_of(deploy(default_topology(), deployment_for(policy)))
        results[policy] = {"deployment": deployment_for(policy), "shape": shape.text(),
                           "stages": shape.stages(), "error": "MeshError: no route"}
    lines = format_comparison(results, "homogeneous").splitlines()
    row = {line[:32].strip(): line[32:].split() for line in lines[2:]}
    assert " ".join(row["shape N_prfaas / N_p / N_d"]) == "- / 3 / 2 1 / - / 4"
    assert " ".join(row["PD prefill workers"]) == "2 x h20 + 1 x h200 -"
    assert " ".join(row["PD decode workers"]) == "2 x h20 4 x h20"
    assert row["TTFT mean (ms)"] == ["error", "error"]
