"""The actor runtime: actors, mailboxes, wire framing, transports, clock, topology, events.

Knows nothing of LLMs.
"""
