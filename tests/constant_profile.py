"""A hardware profile whose answers are known in closed form, for the simulator's tests (not a
test module)."""

from __future__ import annotations


def constant_profile(seconds: float) -> str:
    """TOML of an instance whose prefill takes `seconds` whatever the length, with a decode so
    fast it never matters: one prefill instance saturates at 1 / seconds requests per second."""
    return f'''
name = "constant-{seconds:g}"
description = "a prefill of {seconds} s whatever the length, a decode step of 1 ms"
gpus_per_instance = 1
paced = true
sources = ["tests/constant_profile.py: a closed-form deployment"]
[prefill]
fit = "quadratic"
lengths = [1000, 2000, 3000]
seconds = [{seconds}, {seconds}, {seconds}]
source = {{ kind = "assumed", detail = "a test" }}
[decode]
bs_max = 64
step_s = 0.001
reference_context = 1000
hbm_bytes_per_s = 1e18
source = {{ kind = "assumed", detail = "a test" }}
'''
