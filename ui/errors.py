"""The dashboard's small exception tree.

Foreign errors (httpx transport errors, msgspec validation, bad log lines) are translated once,
where they enter the dashboard, so the app maps exactly these types to HTTP answers.
"""

from __future__ import annotations

# Shared with every implementation of the controls (the simulation's too), so it is the
# contract's; the dashboard re-exports it.
from services.contract.errors import ControlError

__all__ = ["ControlError", "ReplayError", "UiConfigError", "UiError"]


class UiError(Exception):
    """Base of every error the dashboard raises."""


class UiConfigError(UiError, ValueError):
    """A configuration value out of range; the message names the parameter and the value."""


class ReplayError(UiError):
    """A recorded event log that cannot be found, read or played."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
