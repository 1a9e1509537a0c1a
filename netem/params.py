"""The link's parameters, live-changeable, and the one error tree of the link emulator.

`LinkParams` is what the control API sets and the shaper applies: bandwidth (None or 0:
unshaped), one-way delay, jitter, loss (a stall of `rto_s` per lost chunk) and up/down. Every
field is checked on construction; a bad value raises `LinkParamError` naming it.
"""

from __future__ import annotations

import reprlib

import msgspec

# Below one bit per second, 8n / bandwidth overflows towards inf for ordinary chunks and a
# link set that slow could never be drained again; 0 (or None) means unshaped instead.
MIN_BANDWIDTH_BPS = 1.0


class LinkError(Exception):
    """Base of every error the link emulator raises."""


class LinkParamError(LinkError, ValueError):
    """A link parameter holds a bad value; the message names it and the value."""


class _BoundedRepr(reprlib.Repr):
    """reprlib with integers too long for `repr` (Python caps int -> str) told by size."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWN = _BoundedRepr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 60


def shown(value: object) -> str:
    """A bounded repr for error messages: request bodies may be huge or deeply nested."""
    return _SHOWN.repr(value)


def check_number(name: str, value: object, *, low: float, low_open: bool, high: float) -> None:
    """Raise LinkParamError naming `name` and `value` unless it is a number in range."""
    # Compared as they are: Python compares int and float exactly, where float() of a JSON
    # integer of 400 digits would overflow. NaN fails every comparison.
    in_range = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (value > low if low_open else value >= low)
        and value <= high
    )
    if in_range:
        return
    bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
    raise LinkParamError(f"{name} must be a number {bound}, got {shown(value)}")


class LinkParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Live link parameters. `bandwidth_bps` None or 0 means unshaped (no serialisation)."""

    bandwidth_bps: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss_rate: float = 0.0
    rto_s: float = 0.2
    up: bool = True

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None:
            check_number("bandwidth_bps", self.bandwidth_bps, low=0.0, low_open=False, high=1e15)
            if 0 < self.bandwidth_bps < MIN_BANDWIDTH_BPS:
                raise LinkParamError(
                    f"bandwidth_bps must be 0 (unshaped) or >= {MIN_BANDWIDTH_BPS:g}, "
                    f"got {self.bandwidth_bps!r}"
                )
        check_number("delay_s", self.delay_s, low=0.0, low_open=False, high=3600.0)
        check_number("jitter_s", self.jitter_s, low=0.0, low_open=False, high=3600.0)
        check_number("loss_rate", self.loss_rate, low=0.0, low_open=False, high=1.0)
        check_number("rto_s", self.rto_s, low=0.0, low_open=True, high=3600.0)

    @property
    def shaped_bandwidth(self) -> bool:
        return bool(self.bandwidth_bps)

    @property
    def transparent(self) -> bool:
        """True when the link adds nothing: chunks may be forwarded as they come."""
        return self.up and not (
            self.bandwidth_bps or self.delay_s or self.jitter_s or self.loss_rate
        )
