"""The contract's exceptions: errors cross the wire by type name (mesh `RemoteError.error`),
so these are part of the contract as much as the messages are."""

from __future__ import annotations

from mesh.errors import RequestFailed


class DataPathError(RequestFailed):
    """Root of the data path's errors (prefill, decode, KV transfer, launch)."""


class RequestError(DataPathError, ValueError):
    """A request carries an impossible value; the message names the field and the value."""


class KVTransferError(DataPathError):
    """A request's KV did not arrive whole: the stream broke, timed out or does not fit."""


class KVStalled(KVTransferError):
    """A request's KV made no progress for its bound (`DecodeRequest.kv_stall`): abandoned."""


class WrongRole(DataPathError):
    """A worker was asked for work of the role it does not hold (or is draining)."""


class PrefixCacheError(RequestFailed):
    """Base of the prefix cache's errors (tree and directory)."""


class UnknownWorkerError(PrefixCacheError, LookupError):
    """A worker or cluster name the directory does not know."""


class ControlError(RequestFailed):
    """A control request of the dashboard (link, policy, threshold, load, roles, speed) that
    could not be carried out; `status` is its HTTP answer. It lives in the contract so that
    every implementation of the dashboard's controls (ui's HTTP forwarder to the services,
    the simulation's own) raises the one type the dashboard answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
