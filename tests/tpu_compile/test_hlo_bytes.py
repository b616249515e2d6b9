"""hf_tpu.tpu_compile.hlo_bytes on a hand-written scheduled TPU HLO (libtpu's ``*-TLP-hlo.txt`` form): XLA's bytes
accessed re-derived instruction by instruction, and the part of it in HBM. The contract tier
(tests/contract/test_tpu_compile.py) checks the total against libtpu's own count on a compiled decode program."""

from __future__ import annotations

import pytest

from hf_tpu.tpu_compile import hlo_bytes

MIB = 1 << 20

# A weight A read straight from HBM by a fused matrix-vector product; a vector copied whole into on-chip memory
# (copy-start/done, S(1)); a weight B staged into on-chip memory in two slices joined by a ConcatBitcast, then
# read there; a cache copied in HBM (a plain copy), updated in place in one row, and read by a Mosaic kernel.
HLO = """HloModule tiny_decode, is_scheduled=true

%fused_a (param_0.1: bf16[1024,512], param_1.1: bf16[512]) -> bf16[1024] {
  %param_1.1 = bf16[512]{0:T(512)S(1)} parameter(1)
  %broadcast.1 = bf16[1024,512]{1,0:T(8,128)} broadcast(%param_1.1), dimensions={1}
  %param_0.1 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %multiply.1 = bf16[1024,512]{1,0:T(8,128)} multiply(%broadcast.1, %param_0.1)
  %constant.1 = bf16[]{:T(256)} constant(0)
  ROOT %reduce.1 = bf16[1024]{0:T(1024)S(1)} reduce(%multiply.1, %constant.1), dimensions={1}, to_apply=%add
}

%fused_b (param_0.2: bf16[512,1024], param_1.2: bf16[1024]) -> bf16[512] {
  %param_1.2 = bf16[1024]{0:T(1024)S(1)} parameter(1)
  %broadcast.2 = bf16[512,1024]{1,0:T(8,128)} broadcast(%param_1.2), dimensions={1}
  %param_0.2 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %multiply.2 = bf16[512,1024]{1,0:T(8,128)} multiply(%broadcast.2, %param_0.2)
  %constant.2 = bf16[]{:T(256)} constant(0)
  ROOT %reduce.2 = bf16[512]{0:T(512)S(1)} reduce(%multiply.2, %constant.2), dimensions={1}, to_apply=%add
}

ENTRY %main.0 (Arg_0: bf16[1024,512], Arg_1: bf16[512], Arg_2: bf16[512,1024], Arg_3: bf16[1,8,16,128], Arg_4: bf16[1,8,1,128], Arg_5: s32[]) -> (bf16[512], bf16[1,8,16,128]) {
  %Arg_0 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %Arg_1 = bf16[512]{0:T(512)} parameter(1)
  %copy-start = (bf16[512]{0:T(512)S(1)}, bf16[512]{0:T(512)}, u32[]{:S(2)}) copy-start(%Arg_1)
  %copy-done = bf16[512]{0:T(512)S(1)} copy-done(%copy-start)
  %fusion.a = bf16[1024]{0:T(1024)S(1)} fusion(%Arg_0, %copy-done), kind=kLoop, calls=%fused_a
  %Arg_2 = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(2)
  %bitcast.3 = s8[1048576]{0:T(1024)(128)(4,1)} bitcast(%Arg_2)
  %slice-start = ((s8[1048576]{0:T(1024)(128)(4,1)}), s8[524288]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%bitcast.3), slice={[0:524288]}
  %slice-start.1 = ((s8[1048576]{0:T(1024)(128)(4,1)}), s8[524288]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%bitcast.3), slice={[524288:1048576]}
  %slice-done = s8[524288]{0:T(1024)(128)(4,1)S(1)} slice-done(%slice-start)
  %slice-done.1 = s8[524288]{0:T(1024)(128)(4,1)S(1)} slice-done(%slice-start.1)
  %custom-call.1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %fusion.b = bf16[512]{0:T(512)S(1)} fusion(%custom-call.1, %fusion.a), kind=kLoop, calls=%fused_b
  %Arg_3 = bf16[1,8,16,128]{3,2,1,0:T(8,128)(2,1)} parameter(3)
  %Arg_4 = bf16[1,8,1,128]{3,2,1,0:T(8,128)(2,1)} parameter(4)
  %Arg_5 = s32[]{:T(128)} parameter(5)
  %copy.1 = bf16[1,8,16,128]{3,2,1,0:T(8,128)(2,1)} copy(%Arg_3)
  %dynamic-update-slice.1 = bf16[1,8,16,128]{3,2,1,0:T(8,128)(2,1)} dynamic-update-slice(%copy.1, %Arg_4, %Arg_5, %Arg_5, %Arg_5, /*index=5*/%Arg_5)
  %mosaic = bf16[1,8,16,128]{3,2,1,0:T(8,128)(2,1)} custom-call(%dynamic-update-slice.1), custom_call_target="tpu_custom_call"
  ROOT %tuple.1 = (bf16[512]{0:T(512)S(1)}, bf16[1,8,16,128]{3,2,1,0:T(8,128)(2,1)}) tuple(%fusion.b, %mosaic)
}
"""

A = 1024 * 512 * 2  # weight A: 1 MiB
B = 512 * 1024 * 2  # weight B: 1 MiB
VEC = 512 * 2
CACHE = 8 * 16 * 128 * 2  # 32 KiB
ROW = 8 * 8 * 128 * 2  # the update bf16[1,8,1,128], its tile T(8,128) pads the row dimension to 8
S32 = 4


def test_counts_follow_xlas_rules_and_hbm_is_what_lives_in_hbm():
    result = hlo_bytes.split(HLO)
    by = {i.name: i for i in result.instructions}
    assert by["fusion.a"].counted == A + VEC + 1024 * 2  # the weight, the vector (broadcast), its output
    assert by["fusion.a"].hbm == A  # only the weight is in HBM
    assert by["copy-start"].counted == VEC + (VEC + VEC + 4) and by["copy-start"].hbm == VEC
    assert by["copy-done"].counted == VEC and by["copy-done"].hbm == 0
    assert by["slice-start"].counted == B and by["slice-start"].hbm == B // 2  # read from HBM, written on chip
    assert by["slice-done"].counted == 0
    assert by["custom-call.1"].counted == B and by["custom-call.1"].hbm == 0  # the ConcatBitcast's output
    assert by["fusion.b"].counted == B + 1024 * 2 + VEC and by["fusion.b"].hbm == 0  # B read on chip
    assert by["copy.1"].counted == 2 * CACHE and by["copy.1"].hbm == 2 * CACHE  # a copy in HBM
    assert by["dynamic-update-slice.1"].counted == 2 * ROW + 4 * S32  # the update in place, its indices
    assert by["mosaic"].counted == 0 and by["mosaic"].hbm == 2 * CACHE  # left out of XLA's total, not of HBM's
    assert by["tuple.1"].counted == 16
    counted = sum(by[n].counted for n in by)
    assert result.bytes_accessed == counted
    # A counted once; B, staged through on-chip memory, four times (slices read and written, joined, read there)
    assert result.bytes_accessed == pytest.approx(A + 4 * B + 2 * CACHE, rel=0.01)
    assert result.hbm_bytes == A + VEC + B + 2 * CACHE + 2 * CACHE + by["dynamic-update-slice.1"].hbm
    # every parameter read once from HBM; the cache's copy and the kernel are the other HBM traffic
    assert result.parameter_hbm_reads["Arg_0"] == A and result.parameter_hbm_reads["Arg_2"] == B
    assert result.parameters_read_more_than_once() == {}
    assert result.other_hbm() == pytest.approx(result.hbm_bytes - A - VEC - B - CACHE - ROW - 4 * S32)
    kinds = result.by_kind()
    assert kinds["slice-start"] == (2 * B, B, 2) and kinds["ConcatBitcast"] == (B, 0, 1)


def test_shape_sizes_pad_to_the_first_tile_and_know_the_memory_space():
    assert hlo_bytes.Shape("bf16[1,8,1,128]{3,2,1,0:T(8,128)(2,1)S(1)}").bytes() == 8 * 8 * 128 * 2
    assert hlo_bytes.Shape("bf16[1,8,1,128]{3,2,1,0:T(8,128)(2,1)S(1)}").space == 1
    assert hlo_bytes.Shape("bf16[128256]{0:T(1024)(128)(2,1)}").bytes() == 129024 * 2
    assert hlo_bytes.Shape("bf16[128256]{0:T(1024)(128)(2,1)}").in_hbm
    assert hlo_bytes.Shape("(f32[], bf16[4])").bytes() == 16  # a tuple: its index table


def test_cli_reads_a_dump_folder(tmp_path, capsys):
    (tmp_path / "123-TLP-hlo.txt").write_text(HLO)
    assert hlo_bytes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny_decode" in out and "of which in HBM" in out and "ConcatBitcast" in out
    assert hlo_bytes.main([str(tmp_path / "empty")]) == 2
