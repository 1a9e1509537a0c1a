"""services.cli.up: the URLs it waits on, the processes `--here` keeps, the children's
admin token and mesh secret."""

from __future__ import annotations

import httpx
import pytest

from mesh.errors import ConfigError
from mesh.topology import parse_topology
from services.cli.procfile import ProcessSpec
from services.cli.supervisor import Supervisor
from services.cli.up import children_env, control_app, endpoints, here_only
from services.contract.access import MESH_SECRET_ENV, TOKEN_ENV, bearer_headers

TOKEN = "an-admin-token-of-32-characters."
SECRET = "a mesh secret of 32 characters.."
SPECS = (ProcessSpec("router", "r"), ProcessSpec("ui", "u"), ProcessSpec("pd-decode-0", "d"))


def test_a_router_and_dashboard_bound_everywhere_are_dialled_at_their_host() -> None:
    topology = parse_topology(
        '[[services]]\nname = "router"\nkind = "router"\nport = 7100\nhost = "198.18.0.5"\n'
        'bind = "0.0.0.0"\noptions = { http_port = 8000 }\n'
        '[[services]]\nname = "ui"\nkind = "ui"\nport = 7150\nhost = "198.18.0.6"\n'
        'options = { http_host = "0.0.0.0", http_port = 8080 }\n')
    urls = endpoints(topology)
    assert urls.health == "http://198.18.0.5:8000/health"
    assert urls.dashboard == "http://198.18.0.6:8080/"


def test_here_keeps_the_named_processes_in_procfile_order() -> None:
    assert here_only(SPECS, None) == SPECS
    assert here_only(SPECS, "pd-decode-0, router") == (SPECS[0], SPECS[2])
    with pytest.raises(ConfigError, match=r"no process \['nope'\]"):
        here_only(SPECS, "router,nope")
    with pytest.raises(ConfigError, match="at least one"):
        here_only(SPECS, ",")


def test_a_run_gets_a_fresh_secret_and_token_unless_given() -> None:
    bare = parse_topology("")
    first, second = (children_env(bare, {}, generate=True) for _ in range(2))
    assert len(first[MESH_SECRET_ENV]) >= 32 and len(first[TOKEN_ENV]) >= 16
    assert first[MESH_SECRET_ENV] != second[MESH_SECRET_ENV]
    given = children_env(bare, {MESH_SECRET_ENV: SECRET, TOKEN_ENV: TOKEN}, generate=True)
    assert (given[MESH_SECRET_ENV], given[TOKEN_ENV]) == (SECRET, TOKEN)
    # A topology naming its own variable gets the fresh secret there.
    named = parse_topology('[mesh]\nsecret_env = "MY_SECRET"\n')
    assert MESH_SECRET_ENV not in children_env(named, {}, generate=True)
    assert len(children_env(named, {}, generate=True)["MY_SECRET"]) >= 32


def test_here_needs_the_token_and_secret_that_every_machine_shares() -> None:
    bare = parse_topology("")
    with pytest.raises(ConfigError, match=f"--here: set {MESH_SECRET_ENV}"):
        children_env(bare, {TOKEN_ENV: TOKEN}, generate=False)
    with pytest.raises(ConfigError, match=f"--here: set {TOKEN_ENV}"):
        children_env(bare, {MESH_SECRET_ENV: SECRET}, generate=False)
    env = children_env(bare, {MESH_SECRET_ENV: SECRET, TOKEN_ENV: TOKEN}, generate=False)
    assert env[MESH_SECRET_ENV] == SECRET
    with pytest.raises(ConfigError, match="at least 16"):
        children_env(bare, {MESH_SECRET_ENV: "short", TOKEN_ENV: TOKEN}, generate=False)


def test_a_short_admin_token_stops_the_run_before_any_child() -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        children_env(parse_topology(""), {TOKEN_ENV: "workshop"}, generate=True)


@pytest.mark.anyio
async def test_the_control_api_asks_the_runs_token_and_answers_loopback_hosts_only() -> None:
    # Not started: the API lists the processes it would run all the same.
    app = control_app(Supervisor(SPECS, {}), {TOKEN_ENV: TOKEN})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8090") as client:
        assert (await client.get("/processes")).status_code == 401
        rebound = await client.get("/processes", headers={**bearer_headers(TOKEN),
                                                          "host": "evil.example:8090"})
        assert rebound.status_code == 403
        for host in ("127.0.0.1:8090", "localhost:8090"):
            listed = await client.get("/processes", headers={**bearer_headers(TOKEN),
                                                             "host": host})
            assert listed.status_code == 200, host
