"""magnetar.utils.machine: the CPU a benchmark ran on, in one line."""
from __future__ import annotations

from magnetar.utils.machine import cpu_description


def test_cpu_description_names_the_model_and_its_extensions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    d = cpu_description(info)
    assert d.startswith("AMD EPYC, ") and d.endswith(" CPUs, AVX2 AVX-512 AVX-512-BF16"), d
    info.write_text("model name\t: Intel Xeon\nflags\t\t: avx2 avx512f amx_tile\n")
    assert cpu_description(info).endswith("AVX2 AVX-512 AMX")
    assert "CPUs" in cpu_description(tmp_path / "absent") and "AVX" not in cpu_description(tmp_path / "absent")
