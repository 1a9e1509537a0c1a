"""Topology: TOML decoding, validation with clear errors, lookups by name."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from mesh.errors import ConfigError, UnknownPeer
from mesh.topology import (
    ClusterSpec,
    ServiceSpec,
    Topology,
    load_topology,
    mesh_secret,
    parse_topology,
    topology_toml,
)
from mesh.transport import Address

EXAMPLE = """
[[clusters]]
name = "prfaas"
kind = "remote"

[[clusters]]
name = "pd"

[[services]]
name = "router"
kind = "router"
port = 7100

[[services]]
name = "decode-0"
kind = "decode"
cluster = "pd"
host = "10.0.0.2"
port = 7101
options = { batch = 8, model = "tiny", fast = true, scale = 0.5 }

[[services]]
name = "prefill-0"
kind = "prefill"
cluster = "prfaas"
port = 7102

[[links]]
name = "wan"
a = "prfaas"
b = "pd"
bandwidth_bps = 100e9
delay_s = 0.005
"""


def test_example_decodes_and_answers_lookups() -> None:
    topology = parse_topology(EXAMPLE)
    assert topology.address("decode-0") == Address("10.0.0.2", 7101)
    assert topology.address("router") == Address("127.0.0.1", 7100)
    assert topology.service("decode-0").options == {
        "batch": 8, "model": "tiny", "fast": True, "scale": 0.5}
    assert [s.name for s in topology.find(kind="prefill")] == ["prefill-0"]
    assert [s.name for s in topology.find(cluster="pd")] == ["decode-0"]
    assert topology.cluster("prfaas").kind == "remote"
    (wan,) = topology.links_between("pd", "prfaas")
    assert (wan.bandwidth_bps, wan.delay_s) == (100e9, 0.005)


def test_unknown_names_raise() -> None:
    topology = parse_topology(EXAMPLE)
    with pytest.raises(UnknownPeer, match="'nope'"):
        topology.address("nope")
    with pytest.raises(ConfigError, match="cluster 'moon'"):
        topology.cluster("moon")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('name = "pd"', 'name = "prfaas"'), "duplicate cluster 'prfaas'"),
        (lambda t: t.replace('"prefill-0"', '"router"'), "duplicate service 'router'"),
        (lambda t: t.replace("port = 7102", "port = 7101\nhost = \"10.0.0.2\""),
         "duplicate service address '10.0.0.2:7101'"),
        (lambda t: t.replace('cluster = "pd"', 'cluster = "moon"'),
         "service 'decode-0': unknown cluster 'moon'"),
        (lambda t: t.replace("port = 7100", "port = 0"),
         "service 'router': port must be 1..65535, got 0"),
        (lambda t: t.replace('b = "pd"', 'b = "prfaas"'), "joins cluster 'prfaas' to itself"),
        (lambda t: t.replace('b = "pd"', 'b = "mars"'), "link 'wan': unknown cluster 'mars'"),
        (lambda t: t.replace("100e9", "0.0"), "bandwidth_bps must be > 0, got 0.0"),
        (lambda t: t.replace("0.005", "-1.0"), "delay_s must be >= 0, got -1.0"),
        (lambda t: t.replace("0.005", "0.005\njitter_s = -0.5"), "jitter_s must be >= 0, got -0.5"),
        (lambda t: t.replace("0.005", "0.005\nloss_rate = 1.5"),
         "loss_rate must be in [0, 1], got 1.5"),
        (lambda t: t.replace("kind = \"router\"", "kind = \"router\"\nprot = 1"), "unknown field"),
        (lambda t: t.replace("port = 7100", 'port = "x"'), "Expected `int`, got `str`"),
        (lambda t: t + "[[oops", "not valid TOML"),
    ],
)
def test_invalid_topologies_name_the_problem(edit: Callable[[str], str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_topology(edit(EXAMPLE), "test.toml")


def test_constructed_topology_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="unknown cluster 'x'"):
        Topology(services=(ServiceSpec(name="a", kind="k", port=1, cluster="x"),))
    ok = Topology(clusters=(ClusterSpec(name="x"),),
                  services=(ServiceSpec(name="a", kind="k", port=1, cluster="x"),))
    assert ok.address("a") == Address("127.0.0.1", 1)


def test_load_uses_the_file_or_the_callers_default(tmp_path: Path) -> None:
    path = tmp_path / "mesh.toml"
    path.write_text(EXAMPLE.replace("7100", "7200"), encoding="utf-8")
    assert load_topology(path, default=EXAMPLE).address("router").port == 7200
    assert load_topology(None, default=EXAMPLE).address("router").port == 7100
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_topology(tmp_path / "missing.toml", default=EXAMPLE)
    with pytest.raises(ConfigError, match="<default topology>"):
        load_topology(None, default="[[services]]\nname = 1")


def test_mesh_secret_comes_from_the_named_environment_variable() -> None:
    topology = parse_topology('[mesh]\nsecret_env = "MESH_TEST_SECRET"\n')
    assert mesh_secret(topology, {"MESH_TEST_SECRET": "s" * 20}) == b"s" * 20
    with pytest.raises(ConfigError, match="'MESH_TEST_SECRET' is not set"):
        mesh_secret(topology, {})


def test_mesh_secret_inline_is_hidden_from_repr_and_absent_means_none() -> None:
    topology = parse_topology('[mesh]\nsecret = "an inline secret of 32 chars.."\n')
    assert mesh_secret(topology) == b"an inline secret of 32 chars.."
    assert "inline" not in repr(topology)
    assert mesh_secret(parse_topology(EXAMPLE)) is None


def test_a_service_listens_on_its_bind_host_else_its_host() -> None:
    plain = ServiceSpec(name="a", kind="k", port=7000, host="198.18.0.2")
    assert plain.listen_address == plain.address == Address("198.18.0.2", 7000)
    apart = ServiceSpec(name="a", kind="k", port=7000, host="198.18.0.2", bind="0.0.0.0")
    assert (apart.address, apart.listen_address) == (Address("198.18.0.2", 7000),
                                                     Address("0.0.0.0", 7000))
    assert parse_topology('[[services]]\nname = "a"\nkind = "k"\nport = 1\nbind = "::"\n'
                          ).service("a").bind_host == "::"


def test_mesh_secret_from_a_file_without_its_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"a file secret of 32 characters..\n")
    topology = parse_topology(f'[mesh]\nsecret_file = "{path}"\n')
    assert topology.mesh.configured and not parse_topology(EXAMPLE).mesh.configured
    assert mesh_secret(topology, {}) == b"a file secret of 32 characters.."
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="at least 16"):
        mesh_secret(topology, {})


@pytest.mark.parametrize(
    "text, message",
    [
        ('[mesh]\nsecret = "short"\n', "at least 16"),
        ('[mesh]\nsecret = "x"\nsecret_env = "Y"\n', "give one of .*not secret_env and secret"),
        ('[mesh]\nsecret_file = "x"\nsecret_env = "Y"\n', "not secret_env and secret_file"),
        ('[mesh]\nsecret_file = "/nonexistent/mesh-secret"\n', "secret_file.*No such file"),
        ('[mesh]\nsecrets = "x"\n', "unknown field"),
    ],
)
def test_bad_mesh_sections_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        mesh_secret(parse_topology(text))


def test_topology_toml_keeps_a_dotted_option_one_key() -> None:
    text = ('[[services]]\nname = "router"\nkind = "router"\nport = 7100\n'
            'options = { "prfaas.threshold" = 64.0, http_port = 8000 }\n')
    topology = parse_topology(text)
    again = parse_topology(topology_toml(msgspec.to_builtins(topology)))
    assert again == topology
    assert again.service("router").options["prfaas.threshold"] == 64.0
