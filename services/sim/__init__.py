"""Simulation mode: the live services composed in one trio process on virtual time."""
