"""Helpers for the dashboard's browser tests: the default mesh in a thread, chromium's launch."""
