"""fp16 -> fp32 by integer bit arithmetic, for the HVX kernels (kernels/npu/hvx_int8_matmul.py).

A Hexagon build otherwise converts fp16 with soft-float calls (`__extendhfsf2` / `__truncsfhf2`), and HVX's own
fp16 (`hf` / `qf16`, v68+) is not decoded by qemu-hexagon 7.2, so kernels that must run here read fp16 with
this expression (they round to fp16 in HVX integer lanes: hvx_int8_matmul._to_f16_bits).
"""

from __future__ import annotations

from tvm.script import tirx as T

HAND_WRITTEN = "hvx.hand_written"   # PrimFunc attribute: written with HVX vectors already, not to be rescheduled


def f16_bits_to_f32(h):
    """fp16 bits (an int32 expression, 0..0xffff) as a float32 value, exactly, with integer operations and
    one int -> float conversion for subnormals."""
    sign = T.shift_left(T.bitwise_and(h, 0x8000), 16)
    exp = T.bitwise_and(T.shift_right(h, 10), 0x1F)
    man = T.bitwise_and(h, 0x3FF)
    normal = T.bitwise_or(sign, T.bitwise_or(T.shift_left(exp + 112, 23), T.shift_left(man, 13)))
    special = T.bitwise_or(sign, T.bitwise_or(0x7F800000, T.shift_left(man, 13)))
    bits = T.if_then_else(exp == 31, special, normal)
    tiny = T.Cast("float32", man) * T.float32(2.0 ** -24)
    negative = T.bitwise_and(h, 0x8000) != 0   # not `sign != 0`: TVM folds that shifted test away
    return T.if_then_else(exp == 0, T.if_then_else(negative, -tiny, tiny), T.reinterpret("float32", bits))
