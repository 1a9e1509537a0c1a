"""The `prfaas` dispatcher: usage, unknown commands, lazy resolution of every command."""

from __future__ import annotations

import socket

import pytest

from mesh.topology import parse_topology
from services.cli import main as cli
from services.cli.send import LinkStatsError, link_egress_bytes


def test_usage_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name}" in out
    assert {"serve", "send"} <= set(cli.COMMANDS)


def test_an_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["serve", "send"])
def test_data_path_commands_resolve_and_describe_themselves(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = cli.resolve(name)
    assert callable(entry)
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    assert f"prfaas {name}" in capsys.readouterr().out


@pytest.mark.trio
async def test_link_bytes_read_strictly_fail_when_the_counter_cannot_be_read() -> None:
    """A measurement must not pass on a counter it could not read: strict raises; the
    `prfaas send` report (not strict) reads 0."""
    # A port bound and never listened on: every connection to it is refused.
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        topology = parse_topology(
            '[[clusters]]\nname = "prfaas"\nkind = "prfaas"\n'
            '[[clusters]]\nname = "pd"\nkind = "pd"\n'
            f'[[services]]\nname = "link-0"\nkind = "link"\nport = 1\n'
            f"options = {{ control_port = {port}, proxy_base_port = 2 }}\n"
            '[[links]]\nname = "link-0"\na = "prfaas"\nb = "pd"\nbandwidth_bps = 1e9\n')
        with pytest.raises(LinkStatsError, match="link-0"):
            await link_egress_bytes(topology, timeout=2.0, strict=True)
        assert await link_egress_bytes(topology, timeout=2.0) == {"link-0": 0}
