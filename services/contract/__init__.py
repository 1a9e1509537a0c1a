"""The contract between services: every wire message, every event, the shared names and errors.

Imported by every service; imports no torch and no service."""
