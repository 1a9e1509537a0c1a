"""Fault scenarios against the real processes of the default mesh (`make chaos`).

mesh.py starts the mesh under `prfaas up` and reads its processes; load.py sends requests
with deadlines and sorts every one into completed, error, hung or lost; faults.py breaks
things (kill -9, restarts, the link, fuzzed frames, malformed bodies); scenarios.py runs each
scenario and measures it; report.py writes docs/reliability.md; cli.py is `prfaas chaos`.
"""
