"""The dashboard service."""
