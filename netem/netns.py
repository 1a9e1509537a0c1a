"""Network namespaces joined by veth pairs, some shaped by the kernel (tbf): a few machines'
network on one, made by the run that uses it and removed by it.

A veth may also ask for delay, jitter and loss (`Impairment`). Where the kernel offers the
netem qdisc (`probe_netem`, tried once per lab on its first namespace's loopback), each end
gets netem at the root with tbf as its child (`shaping_args`); where it does not, the veth
gets tbf alone and `NetLab.netem_refusal` says why, so that the caller leaves the impairment
to something else.

Every name a `NetLab` makes carries `PREFIX` and its owner's pid (`pfm1234pd`, `pfm1234x0`),
so that `remove_stale` can remove what a run that died left behind without touching a run
that is still alive. Deleting a namespace deletes the veth ends and qdiscs inside it; a root
end is deleted with its peer. Every address is in 198.18.0.0/15, the range set aside for
network benchmarks (RFC 2544): a lab never takes an address that could be someone's.

Needs root (CAP_NET_ADMIN) and the `ip` and `tc` commands of iproute2.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "pfm"
BENCHMARK_NETWORK = ipaddress.ip_network("198.18.0.0/15")
# Jumbo frames on every veth: a KV transfer's headers then cost under 1% of the shaped rate
# (tbf counts them; at 1500 bytes they would be 4.4%).
VETH_MTU = 9000
# tbf's queue bound in time, and its bucket: at least a 64 KiB GSO packet, else 2 ms of rate.
TBF_LATENCY = "100ms"
TBF_MIN_BURST_BYTES = 1 << 18
TBF_BURST_S = 0.002
COMMAND_TIMEOUT_S = 10.0
# netem queues every packet for its delay: its limit (packets) must hold the delay's worth
# at the rate, counted in packets as small as an Ethernet frame, twice over; never below
# netem's own default.
NETEM_MIN_LIMIT = 1000
NETEM_LIMIT_PACKET_BYTES = 1500
# Where the probe tries netem: the loopback of a namespace the lab made (nothing else sees it).
NETEM_PROBE_DEVICE = "lo"
_OWNED = re.compile(rf"^{PREFIX}(\d+)[a-z]")


class NetnsError(RuntimeError):
    """A namespace, veth or qdisc could not be made (or iproute2 is missing, or not root)."""


@dataclass(frozen=True)
class Impairment:
    """What a netem qdisc adds to a veth end's egress: one-way delay, jitter (each packet's
    delay uniform within +-jitter_s, as the project's emulator draws it) and the fraction of
    packets lost."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            if not getattr(self, name) >= 0:
                raise NetnsError(f"Impairment {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.loss_rate <= 1:
            raise NetnsError(f"Impairment loss_rate must be in [0, 1], got {self.loss_rate}")

    @property
    def asked(self) -> bool:
        """Whether it adds anything."""
        return bool(self.delay_s or self.jitter_s or self.loss_rate)


@dataclass(frozen=True)
class Veth:
    """A veth pair from namespace role `a` to role `b` (None: the root namespace), each end
    with its address (a /30 of 198.18.0.0/15), each end's egress shaped to `rate_bps` by a
    tbf qdisc (0: unshaped) and impaired by netem where the kernel has it."""

    a: str | None
    b: str | None
    a_address: str
    b_address: str
    rate_bps: float = 0.0
    impairment: Impairment = Impairment()

    def __post_init__(self) -> None:
        for address in (self.a_address, self.b_address):
            check_address(address)
        if not self.rate_bps >= 0:
            raise NetnsError(f"Veth rate_bps must be >= 0, got {self.rate_bps}")


@dataclass(frozen=True)
class Route:
    """In namespace `where` (None: root), `destination` (one address) via `via`."""

    where: str | None
    destination: str
    via: str

    def __post_init__(self) -> None:
        check_address(self.destination)
        check_address(self.via)


def check_address(address: str) -> None:
    """NetnsError unless `address` is in 198.18.0.0/15."""
    try:
        inside = ipaddress.ip_address(address) in BENCHMARK_NETWORK
    except ValueError as exc:
        raise NetnsError(f"address {address!r} is not an IP address") from exc
    if not inside:
        raise NetnsError(f"address {address!r} is outside {BENCHMARK_NETWORK} (the range for "
                         "network benchmarks, the only one a lab may use)")


def require_netns() -> None:
    """NetnsError with what is missing unless this process may make namespaces."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root (CAP_NET_ADMIN): run as root, e.g. "
                         "`sudo make multihost`")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(f"the {tool!r} command (iproute2) is not installed")


def run_ip(args: Sequence[str], *, tool: str = "ip") -> str:
    """Runs `ip ARGS` (or `tc ARGS`); NetnsError with its stderr when it fails."""
    try:
        done = subprocess.run([tool, *args], capture_output=True, text=True, check=False,
                              timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{tool} {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{tool} {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def tbf_args(device: str, rate_bps: float, parent: str = "") -> list[str]:
    """`tc` arguments of a tbf on `device` at `rate_bps`: the root qdisc, or (`parent`, a
    class id such as "1:1") the child of the qdisc there."""
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bps / 8 * TBF_BURST_S))
    where = ["parent", parent, "handle", "2:"] if parent else ["root"]
    return ["qdisc", "add", "dev", device, *where, "tbf", "rate", f"{int(rate_bps)}bit",
            "burst", str(burst), "latency", TBF_LATENCY]


def _tc_time(seconds: float) -> str:
    return f"{round(seconds * 1e6)}us"


def netem_limit(rate_bps: float, impairment: Impairment) -> int:
    """netem's queue bound in packets: twice the longest delay's worth at the rate."""
    in_flight = rate_bps / 8 * (impairment.delay_s + impairment.jitter_s)
    return max(NETEM_MIN_LIMIT, math.ceil(2 * in_flight / NETEM_LIMIT_PACKET_BYTES))


def netem_args(device: str, impairment: Impairment, rate_bps: float = 0.0) -> list[str]:
    """`tc` arguments of a root netem (handle 1:) on `device` adding `impairment`."""
    args = ["qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
            "limit", str(netem_limit(rate_bps, impairment)),
            "delay", _tc_time(impairment.delay_s)]
    if impairment.jitter_s:
        args.append(_tc_time(impairment.jitter_s))
    if impairment.loss_rate:
        args += ["loss", f"{impairment.loss_rate * 100:.6g}%"]
    return args


def shaping_args(device: str, veth: Veth, *, netem: bool) -> list[list[str]]:
    """The `tc` argument lists that shape one end of `veth`, in order: with `netem` (the
    kernel has it) and an impairment asked, netem at the root and the rate's tbf as its
    child (netem holds each packet for its delay, then tbf paces it out); else the tbf
    alone (none when unshaped)."""
    if netem and veth.impairment.asked:
        child = [tbf_args(device, veth.rate_bps, parent="1:1")] if veth.rate_bps else []
        return [netem_args(device, veth.impairment, veth.rate_bps), *child]
    return [tbf_args(device, veth.rate_bps)] if veth.rate_bps else []


def netem_probe_args(device: str = NETEM_PROBE_DEVICE) -> list[str]:
    """`tc` arguments that add a netem qdisc doing nothing: it fails where netem is absent."""
    return ["qdisc", "add", "dev", device, "root", "netem", "delay", "0us"]


def probe_netem(namespace: str) -> str:
    """Why the kernel cannot add a netem qdisc ("" when it can): tried on the loopback of
    `namespace` (one the caller made), removed again."""
    try:
        run_ip(["-n", namespace, *netem_probe_args()], tool="tc")
    except NetnsError as exc:
        return str(exc)
    run_ip(["-n", namespace, "qdisc", "del", "dev", NETEM_PROBE_DEVICE, "root"], tool="tc")
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_names() -> tuple[list[str], list[str]]:
    """Namespaces, and root-namespace links, whose names a lab made."""
    namespaces = [line.split()[0] for line in run_ip(["netns", "list"]).splitlines() if line]
    links = [line.split()[0].split("@")[0]
             for line in run_ip(["-br", "link", "show"]).splitlines() if line]
    return ([n for n in namespaces if _OWNED.match(n)], [k for k in links if _OWNED.match(k)])


def remove_stale() -> list[str]:
    """Removes what labs whose owner is gone left behind; the names removed."""
    namespaces, links = owned_names()
    stale = [name for name in namespaces + links
             if not _pid_alive(int(_OWNED.match(name).group(1)))]  # type: ignore[union-attr]
    for name in stale:
        _remove(name, is_namespace=name in namespaces)
    return stale


def _remove(name: str, *, is_namespace: bool) -> None:
    try:
        run_ip(["netns", "del", name] if is_namespace else ["link", "del", name])
    except NetnsError:
        # Gone already: deleting a namespace deletes the root ends of its veths.
        namespaces, links = owned_names()
        if name in namespaces + links:
            raise


class NetLab:
    """Namespaces (by role), veths and routes of one run; `with lab:` makes them and removes
    them on the way out, whatever ends the block. Names carry `owner` (default: this pid).

    `netem_refusal`, once made: None when no veth asks for an impairment (nothing probed),
    "" when the kernel's netem adds them, else why it cannot (the veths then have tbf only).
    """

    def __init__(self, roles: Sequence[str], veths: Sequence[Veth], routes: Sequence[Route] = (),
                 owner: int | None = None) -> None:
        self.owner = os.getpid() if owner is None else owner
        self.roles, self.veths, self.routes = tuple(roles), tuple(veths), tuple(routes)
        for role in self.roles:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", role):
                raise NetnsError(f"namespace role must be 1-6 of [a-z0-9], got {role!r}")
        self.netem_refusal: str | None = None

    def namespace(self, role: str) -> str:
        """The name of role's namespace (`ip netns exec NAME ...`)."""
        if role not in self.roles:
            raise NetnsError(f"role must be one of {list(self.roles)}, got {role!r}")
        return f"{PREFIX}{self.owner}{role}"

    def exec_prefix(self, role: str | None) -> list[str]:
        """The argv prefix that runs a command in role's namespace (None: here)."""
        return [] if role is None else ["ip", "netns", "exec", self.namespace(role)]

    def __enter__(self) -> NetLab:
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def kernel_impairs(self) -> bool:
        """Whether the veths' impairments are the kernel's (netem), once made."""
        return self.netem_refusal == ""

    def create(self) -> None:
        for role in self.roles:
            run_ip(["netns", "add", self.namespace(role)])
            run_ip(["-n", self.namespace(role), "link", "set", "lo", "up"])
        if any(veth.impairment.asked for veth in self.veths):
            self.netem_refusal = (probe_netem(self.namespace(self.roles[0])) if self.roles
                                  else "no namespace of the lab's own to probe netem in")
        for index, veth in enumerate(self.veths):
            self._veth(index, veth)
        for route in self.routes:
            run_ip([*self._in(route.where), "route", "add", route.destination, "via",
                    route.via])

    def remove(self) -> None:
        """Deletes every namespace and root link of this lab that exists."""
        namespaces, links = owned_names()
        mine = f"{PREFIX}{self.owner}"
        for name in namespaces + links:
            if _OWNED.match(name) and name.startswith(mine) and name[len(mine)].isalpha():
                _remove(name, is_namespace=name in namespaces)

    def device(self, index: int, end: str) -> str:
        """The interface name of veth `index`'s end "a" or "b"."""
        return f"{PREFIX}{self.owner}v{index}{end}"

    def _in(self, role: str | None) -> list[str]:
        return [] if role is None else ["-n", self.namespace(role)]

    def _veth(self, index: int, veth: Veth) -> None:
        a, b = self.device(index, "a"), self.device(index, "b")
        run_ip(["link", "add", a, "mtu", str(VETH_MTU), "type", "veth", "peer", "name", b,
                "mtu", str(VETH_MTU)])
        for role, device, address in ((veth.a, a, veth.a_address), (veth.b, b, veth.b_address)):
            if role is not None:
                run_ip(["link", "set", device, "netns", self.namespace(role)])
            run_ip([*self._in(role), "addr", "add", f"{address}/30", "dev", device])
            run_ip([*self._in(role), "link", "set", device, "up"])
            for args in shaping_args(device, veth, netem=self.kernel_impairs):
                run_ip([*self._in(role), *args], tool="tc")
