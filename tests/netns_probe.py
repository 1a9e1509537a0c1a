"""What the namespace tests share: whether this machine lets a test make network namespaces
(skip with the reason where it does not), whether its kernel has the netem qdisc, and the
namespaces and links there are now (a test compares them before and after, to see it left
nothing behind)."""

from __future__ import annotations

import subprocess

import pytest

from netem.netns import NetLab, NetnsError, probe_netem, require_netns

NetworkState = tuple[list[str], list[str]]


def _can_make_namespaces() -> str:
    """Why namespaces cannot be made here ("" if they can)."""
    try:
        require_netns()
        with NetLab(("probe",), []):
            return ""
    except NetnsError as exc:
        return str(exc)


NETNS_REFUSED = _can_make_namespaces()
needs_netns = pytest.mark.skipif(bool(NETNS_REFUSED), reason=f"no namespaces: {NETNS_REFUSED}")


def _netem_refusal() -> str:
    """Why the kernel cannot add a netem qdisc ("" if it can), tried in a namespace made for
    it; "no namespaces" where none can be made."""
    if NETNS_REFUSED:
        return f"no namespaces: {NETNS_REFUSED}"
    with NetLab(("probe",), []) as lab:
        return probe_netem(lab.namespace("probe"))


NETEM_REFUSED = _netem_refusal()


def network_state() -> NetworkState:
    """Every namespace and root link there is, by name."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True,
                           check=True).stdout
    return (sorted(line.split()[0] for line in namespaces.splitlines() if line),
            sorted(line.split()[0] for line in links.splitlines() if line))
