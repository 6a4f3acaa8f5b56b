"""What a measurement records of the machine it ran on (agent/world/environment.py)."""
import pytest

from agent.world.environment import accelerator, cpu_isa, hardware

EPYC_AVX2 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2 rdseed
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 avx512f
"""
EPYC_AVX512 = """model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512vl
"""


def test_two_cpus_of_one_name_are_told_apart_by_their_vector_extensions():
    assert cpu_isa(EPYC_AVX2) == "avx2"  # the first processor's flags line only
    assert cpu_isa(EPYC_AVX512) == "avx2 avx512f avx512_bf16 avx512_vnni"
    assert cpu_isa("model name\t: AMD EPYC\n") == "unknown"
    assert cpu_isa("flags\t\t: fpu sse2\n") == ""


def test_a_cpu_measurement_records_the_extensions_of_this_machine():
    found = accelerator([])
    if found["gpu"] != "cpu":
        pytest.skip("a GPU machine records its GPU")
    assert found["cpu_isa"] == cpu_isa() and found["cpu_isa"] != "unknown"


def test_a_report_names_the_cpu_with_its_extensions_and_a_gpu_by_its_name():
    assert hardware({"gpu": "cpu", "cpu": "AMD EPYC", "cpu_isa": "avx2"}) == "cpu (AMD EPYC, avx2)"
    assert hardware({"gpu": "cpu", "cpu": "AMD EPYC"}) == "cpu (AMD EPYC)"  # a study recorded before the field
    assert hardware({"gpu": "NVIDIA H200", "gpu_count": 1}) == "NVIDIA H200"
