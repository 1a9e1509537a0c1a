"""services.cli.launch: `prfaas serve` children, started together and stopped on the way out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from mesh.node import Node
from mesh.transport import Address, TcpTransport
from mesh.wire import Codec
from services.cli.launch import LaunchError, launch
from services.contract.messages import CODEC_MESSAGES, Echo
from tests.ports import free_port


@pytest.mark.trio
@pytest.mark.slow
async def test_launch_runs_prfaas_serve_children(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "topology.toml"
    path.write_text(f'[[services]]\nname = "echo"\nkind = "echo"\nport = {port}\n'
                    f'[[services]]\nname = "broken"\nkind = "teapot"\nport = {port + 1}\n')
    backend = ["--backend", os.environ.get("PRFAAS_E2E_BACKEND", "uvloop")]
    with launch(path, ["echo"], extra_args=backend, log_dir=tmp_path,
                ready_timeout=60) as children:
        node = Node("client", Codec(CODEC_MESSAGES), TcpTransport(),
                    {"echo": Address("127.0.0.1", port)})
        async with node:
            with trio.fail_after(10):
                assert (await node.call("echo", Echo(text="x"), Echo)).hops == 1
        assert children["echo"].poll() is None
    assert children["echo"].poll() is not None
    with pytest.raises(LaunchError, match="'broken' exited with code 2 before ready"), \
            launch(path, ["broken"], ready_timeout=60):
        pass
