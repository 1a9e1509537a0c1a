"""The control API's vocabulary: its /link fields and Toxiproxy's toxics, mapped onto
`LinkParams` (netem/params.py) and back.

`apply_link_update` turns a /link body (bandwidth_bps, delay_ms, jitter_ms, loss, rto_ms,
up) into new parameters; `toxic_update` does the same for a toxic (latency, bandwidth,
packet_loss, timeout); `params_view` and `active_toxics` say what is set, in API units.
Every bad key or value raises `LinkParamError` naming it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from netem.params import LinkParamError, LinkParams, check_number, shown

# API key -> (LinkParams field, scale to SI units, low bound, low bound open, high bound).
_API_FIELDS: dict[str, tuple[str, float, float, bool, float]] = {
    "bandwidth_bps": ("bandwidth_bps", 1.0, 0.0, False, 1e15),
    "delay_ms": ("delay_s", 1e-3, 0.0, False, 3.6e6),
    "jitter_ms": ("jitter_s", 1e-3, 0.0, False, 3.6e6),
    "loss": ("loss_rate", 1.0, 0.0, False, 1.0),
    "rto_ms": ("rto_s", 1e-3, 0.0, True, 3.6e6),
}

# Toxic type -> attribute -> (API key it sets, scale to API units, high bound).
TOXICS: dict[str, dict[str, tuple[str, float, float]]] = {
    "latency": {"latency": ("delay_ms", 1.0, 3.6e6), "jitter": ("jitter_ms", 1.0, 3.6e6)},
    "bandwidth": {"rate": ("bandwidth_bps", 8000.0, 1e11)},
    "packet_loss": {"loss_rate": ("loss", 1.0, 1.0)},
    "timeout": {"timeout": ("", 0.0, 3.6e9)},
}


def apply_link_update(params: LinkParams, update: object) -> LinkParams:
    """`params` with a /link update applied; LinkParamError names a bad key or value."""
    if not isinstance(update, dict):
        raise LinkParamError(f"body must be a JSON object, got {shown(update)}")
    changes: dict[str, Any] = {}
    for key, value in update.items():
        if key == "up":
            if not isinstance(value, bool):
                raise LinkParamError(f"up must be true or false, got {shown(value)}")
            changes["up"] = value
        elif key not in _API_FIELDS:
            raise LinkParamError(f"unknown parameter {key!r}; known: up, {', '.join(_API_FIELDS)}")
        elif key == "bandwidth_bps" and value is None:
            changes["bandwidth_bps"] = None
        else:
            field, scale, low, low_open, high = _API_FIELDS[key]
            check_number(key, value, low=low, low_open=low_open, high=high)
            changes[field] = float(value) * scale
    if changes.get("bandwidth_bps") == 0.0:
        changes["bandwidth_bps"] = None
    return msgspec.structs.replace(params, **changes)


def params_view(params: LinkParams) -> dict[str, Any]:
    """Link parameters in the API's units (the keys POST /link accepts)."""
    return {
        "bandwidth_bps": params.bandwidth_bps or None,
        "delay_ms": params.delay_s * 1e3,
        "jitter_ms": params.jitter_s * 1e3,
        "loss": params.loss_rate,
        "rto_ms": params.rto_s * 1e3,
        "up": params.up,
    }


def active_toxics(params: LinkParams) -> dict[str, dict[str, float]]:
    """The Toxiproxy toxics that the parameters amount to, with their attributes."""
    toxics: dict[str, dict[str, float]] = {}
    if params.delay_s or params.jitter_s:
        toxics["latency"] = {"latency": params.delay_s * 1e3, "jitter": params.jitter_s * 1e3}
    if params.bandwidth_bps:
        toxics["bandwidth"] = {"rate": params.bandwidth_bps / 8000.0}
    if params.loss_rate:
        toxics["packet_loss"] = {"loss_rate": params.loss_rate}
    if not params.up:
        toxics["timeout"] = {"timeout": 0.0}
    return toxics


def toxic_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in TOXICS:
        raise LinkParamError(f"type must be one of {', '.join(TOXICS)}; got {shown(kind)}")
    return kind


def toxic_update(kind: str, attributes: object, *, create: bool) -> dict[str, Any]:
    """A toxic's attributes as a /link update; on create, missing attributes are zero."""
    if not isinstance(attributes, dict):
        raise LinkParamError(f"attributes must be a JSON object, got {shown(attributes)}")
    table = TOXICS[kind]
    given = ({name: 0.0 for name in table} if create else {}) | attributes
    update: dict[str, Any] = {"up": False} if kind == "timeout" else {}
    for name, value in given.items():
        if name not in table:
            raise LinkParamError(f"unknown {kind} attribute {name!r}; known: {', '.join(table)}")
        key, scale, high = table[name]
        check_number(name, value, low=0.0, low_open=False, high=high)
        if key:
            update[key] = float(value) * scale
    return update


def new_toxic(body: dict[str, Any]) -> tuple[str, str, str]:
    """A created toxic's type, stream and chosen name ("" when none), each checked."""
    kind, stream, name = (
        toxic_kind(body.get("type")),
        body.get("stream", "downstream"),
        body.get("name", ""),
    )
    if body.get("toxicity", 1.0) != 1.0:
        raise LinkParamError(f"toxicity must be 1 (whole link), got {shown(body['toxicity'])}")
    if stream not in ("upstream", "downstream"):
        raise LinkParamError(f"stream must be 'upstream' or 'downstream', got {shown(stream)}")
    if name is None:
        name = ""
    if not isinstance(name, str) or len(name) > 200:
        raise LinkParamError(f"name must be a string of at most 200 characters, got {shown(name)}")
    return kind, stream, name


REMOVALS: dict[str, dict[str, Any]] = {
    "latency": {"delay_ms": 0.0, "jitter_ms": 0.0},
    "bandwidth": {"bandwidth_bps": None},
    "packet_loss": {"loss": 0.0},
    "timeout": {"up": True},
}
