"""The `prfaas` dispatcher: usage, unknown commands, lazy resolution of every command."""

from __future__ import annotations

import pytest

from services.cli import main as cli


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
