"""The contract's exceptions: errors cross the wire by type name (mesh `RemoteError.error`),
so these are part of the contract as much as the messages are."""

from __future__ import annotations


class DataPathError(Exception):
    """Root of the data path's errors (prefill, decode, KV transfer, launch)."""


class RequestError(DataPathError, ValueError):
    """A request carries an impossible value; the message names the field and the value."""


class KVTransferError(DataPathError):
    """A request's KV did not arrive whole: the stream broke, timed out or does not fit."""


class WrongRole(DataPathError):
    """A worker was asked for work of the role it does not hold (or is draining)."""


class PrefixCacheError(Exception):
    """Base of the prefix cache's errors (tree and directory)."""


class UnknownWorkerError(PrefixCacheError, LookupError):
    """A worker or cluster name the directory does not know."""
