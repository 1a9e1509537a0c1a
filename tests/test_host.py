"""services/bench/host.py: the words every measurement names its machine with."""

from __future__ import annotations

from pathlib import Path

from services.bench.host import cpu_name, machine_line


def test_the_cpu_is_named_with_its_widest_vector_extensions(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n"
                    "processor\t: 1\nmodel name\t: ignored, the first CPU speaks\n")
    assert cpu_name(info) == "Intel(R) Xeon(R) Processor [amx_tile avx512_bf16 avx512f avx2]"
    info.write_text("model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n")
    assert cpu_name(info) == "AMD EPYC 7B13 [avx2]"
    assert cpu_name(tmp_path / "absent")  # the platform's words, never empty


def test_a_model_measurement_names_its_threads_and_torch() -> None:
    assert "torch thread" not in machine_line()
    line = machine_line(2)
    assert "logical CPUs" in line and "2 torch thread(s), torch 2." in line
