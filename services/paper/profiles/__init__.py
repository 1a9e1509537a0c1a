"""Hardware and model profiles as TOML data, read by services/paper/hardware.py (a package so that
the TOML files ship as package data)."""
