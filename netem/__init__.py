"""The link emulator: a pure clock-driven shaper and the TCP proxy service."""
