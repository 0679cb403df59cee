"""CPU features (backends/cpu.py): read from /proc/cpuinfo's text, table-driven."""

from __future__ import annotations

import pytest

from backends.cpu import KERNEL_FLAGS, kernel_features, parse_flags

XEON_AMX = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse4_2 avx avx2 fma "
            "f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd avx512vbmi avx512_vnni "
            "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n")
ZEN2 = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 sha_ni\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 asimddp\n"


@pytest.mark.parametrize("text, has, lacks", [
    (XEON_AMX, {"amx_int8", "avx512_fp16", "avx512vbmi"}, {"avx_vnni"}),
    (ZEN2, {"avx2", "fma"}, {"avx512f", "amx_int8"}),
    (ARM, {"asimddp"}, {"avx2"}),
    ("", set(), {"avx2"}),
])
def test_parse_flags(text: str, has: set[str], lacks: set[str]) -> None:
    flags = parse_flags(text)
    assert has <= flags and not lacks & flags


def test_kernel_features_keep_their_order_and_drop_the_rest() -> None:
    feats = kernel_features(parse_flags(XEON_AMX))
    assert list(feats) == [f for f in KERNEL_FLAGS if f in feats]
    assert "fpu" not in feats and feats[-1] == "amx_bf16"
    assert kernel_features(parse_flags(ARM)) == ()
