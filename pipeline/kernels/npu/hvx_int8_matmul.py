"""HVX byte-dot-product kernels for the q4 / q8 decode GEMVs and prefill matmuls (KN weights, fp16 activations).

Activations are quantized per group of 32 to int8 and multiplied with the codes by `vrmpy` byte dot products
(the approach of llama.cpp's Hexagon backend, written here from the ISA): weights are never dequantized, no
soft-float, no HVX float (qf32 / hf, which qemu-hexagon 7.2 cannot decode, so every kernel here runs under it).

- q4 codes: a 128-byte vector of KN code words is 32 columns x 8 nibbles; `v & 0x0f0f0f0f` holds the codes of
  the even k, `(v >> 4) & 0x0f0f0f0f` those of the odd k, and `vrmpy(Vu.ub, Rt.b)` adds four code x activation
  products per column (Rt: 4 int8 activations); the accumulators start at -7 x the group's activation sum
  (the codes' zero point).
- q8 codes: a KN row holds one k for 128 columns; `vrmpy` wants four consecutive k of one column in each
  32-bit lane. Four rows are interleaved in registers (a byte, then a halfword `vshuff(Vu, Vv, Rt)`) into four
  vectors of 32 columns x 4 k, each multiplied with the splat of four int8 activations by `vrmpy(Vu.b, Vv.b)`
  (signed x signed: q8 has no zero point). A block is 128 columns; when N is not a multiple of 128 the last
  block starts at N - 128 and recomputes (and rewrites, identically) the columns it shares with the one before.
- prompt rows: a prefill computes ROWS prompt rows per pass over the weights, so each weight vector loaded
  (and unpacked or shuffled) feeds ROWS rows' vrmpy. The int8 activations of the whole prompt are made once
  per call (K bytes + 3 words per group and row: a workspace of activations, never of weights); rows past the
  prompt's end are zeros and are not stored.
- the scaling is integer HVX too (block floating point): the activation step is rounded to 16 significant bits
  (step = x_mant x 2^x_exp), a weight scale is exactly an 11-bit signed mantissa x 2^w_exp (fp16); a group's term
  dot x w_mant x x_mant / 2^16 (`vmpye(Vu.w, Vv.uh)`) is below 2^30 in magnitude, and is shifted right into a per
  column frame (the largest w_exp + x_exp over the groups, found in a first pass over the scales, less `headroom`
  bits so that all groups add in int32) and summed; the sum becomes fp16 (nearest even, subnormals, inf) with
  `vcl0` and shifts. Per group and 32 columns that is about ten HVX instructions where a scalar fp32 epilogue
  (this project's first q4 GEMV) took about a hundred packets. A group's truncations lose at most one unit of the frame:
  2^(headroom - 30) of the largest term it holds.

The activations' int8 steps are integer HVX as well (`_quantize`: a 30-bit reciprocal of the step's mantissa,
`vmpye` and a rounding shift per lane); still scalar per activation: the max |x| of each group (an integer max
of fp16 bit patterns) and packing the steps into the words vrmpy reads. Not multi-threaded: TVM's parallel loops
call the runtime's thread pool, which a Hexagon build would get from a Hexagon TVM runtime (not in the wheel);
one HVX context runs each kernel.
"""

from __future__ import annotations

from tvm import ir, tirx
from tvm.script import tirx as T

from pipeline.formats import GROUP, ZERO
from pipeline.kernels.cpu.packed import substitute
from pipeline.kernels.cpu.recognize import blocks
from pipeline.kernels.npu.hvx_fp16 import HAND_WRITTEN, f16_bits_to_f32

GEMV_RULES = {"q4": "hvx-q4-vrmpy", "q8": "hvx-q8-vrmpy"}
PREFILL_RULES = {"q4": "hvx-q4-prefill-vrmpy", "q8": "hvx-q8-prefill-vrmpy"}
INT8_RULES = (*GEMV_RULES.values(), *PREFILL_RULES.values())   # the placement rules of this module's kernels
ROWS = 4             # prompt rows per pass over the weights (accumulators: ROWS x 4 of the 32 HVX registers for q8)
LANES = 32           # int32 lanes of one 128-byte HVX vector
Q8_COLUMNS = 128     # q8: columns of one KN row vector
Q4_COLUMNS = 32      # q4: columns of one KN code-word vector (8 nibbles each)
VRMPY_ACC = "llvm.hexagon.V6.vrmpybus.acc.128B"     # Vx.w += vrmpy(Vu.ub, Rt.b): q4 codes x 4 activations
VRMPY_BB_ACC = "llvm.hexagon.V6.vrmpybv.acc.128B"    # Vx.w += vrmpy(Vu.b, Vv.b): q8 codes x splat activations
NIBBLES = 0x0F0F0F0F
SHUFFLE_PAIR = "llvm.hexagon.V6.vshuffvdd.128B"      # Vdd = vshuff(Vu, Vv, Rt): interleave Vv / Vu elements of |Rt| bytes
LOW, HIGH = "llvm.hexagon.V6.lo.128B", "llvm.hexagon.V6.hi.128B"
SCALE_HIGH = "llvm.hexagon.V6.vmpyewuh.128B"           # Vd.w = (Vu.w x Vv.uh[even]) >> 16
LEADING_ZEROS = "llvm.hexagon.V6.vcl0w.128B"          # Vd.uw = vcl0(Vu.uw)


def _load_f16(x, r, i):
    """x[0, r, i] (fp16) as float32, by bit arithmetic."""
    return f16_bits_to_f32(T.Cast("int32", T.reinterpret("uint16", x[0, r, i])))


def _to_int8(s):
    """Round half away from zero (|s| <= 127 here) with a truncating conversion, no libm call."""
    return T.Cast("int32", T.if_then_else(s >= T.float32(0), s + T.float32(0.5), s - T.float32(0.5)))


def _vec(value: int):
    return T.broadcast(T.int32(value), LANES)


def _shuffle(u, v, size: int):
    """The pair interleaving `size`-byte elements of v (even places) and u (odd places)."""
    return T.call_llvm_pure_intrin("int32x64", SHUFFLE_PAIR, u, v, T.int32(-size))


def _half(pair, name: str):
    return T.call_llvm_pure_intrin("int32x32", name, pair)


def _scale_bits(h):
    """fp16 scales (float16x32) as their bit patterns in int32 lanes."""
    return T.Cast("int32x32", T.reinterpret("uint16x32", h))


def _scale_exp(h):
    """The power of two of the lowest mantissa bit of fp16 scales: max(exponent field, 1) - 25."""
    return T.max(T.bitwise_and(T.shift_right(_scale_bits(h), _vec(10)), _vec(31)), _vec(1)) - _vec(25)


def _to_f16_bits(total, exp):
    """fp16 bits (in int32 lanes) of total x 2^exp, rounded to nearest even, in HVX integer lanes: |total| < 2^31 - 2^30
    (the headroom), the result's sign from total, inf above the fp16 range, subnormals below it."""
    neg = T.shift_right(total, _vec(31))                       # 0 or -1
    mag = T.bitwise_xor(total, neg) - neg
    top = _vec(31) - T.call_llvm_pure_intrin("int32x32", LEADING_ZEROS, mag)   # the leading bit (-1 for 0)
    # keep 11 significant bits (normal) or the bits from 2^-24 up (subnormal): shift right by r (left when r < 0)
    r = T.max(top - _vec(10), _vec(-24) - exp)
    right, left = T.min(T.max(r, _vec(0)), _vec(31)), T.max(-r, _vec(0))
    kept = T.shift_right(mag, right)
    half = T.shift_right(T.shift_left(_vec(1), right), _vec(1))
    bias = T.bitwise_and(half - _vec(1) + T.bitwise_and(kept, _vec(1)), -T.min(right, _vec(1)))   # ties to even
    rounded = T.shift_left(T.shift_right(mag + bias, right), left)
    # a normal's exponent field minus one, plus its 11-bit significand, carries a rounding overflow into the exponent
    field = T.max(top + exp + _vec(15), _vec(1)) - _vec(1)
    bits = T.min(T.shift_left(field, _vec(10)) + rounded, _vec(0x7C00))
    return T.bitwise_or(T.bitwise_and(bits, -T.min(mag, _vec(1))), T.bitwise_and(neg, _vec(0x8000)))


def _quantize(h, recip, x_exp):
    """A group's 32 fp16 activations (bits in int32 lanes) as int8 steps of x_mant x 2^x_exp, rounded half away
    from zero, in HVX integer lanes: |x| = m x 2^e (11-bit m), q = m x recip / 2^16 (`vmpye`) shifted right by
    x_exp + 29 - e with rounding, recip = 2^45 / x_mant."""
    e5 = T.bitwise_and(T.shift_right(h, _vec(10)), _vec(31))
    mant = T.bitwise_or(T.bitwise_and(h, _vec(1023)), T.shift_left(T.min(e5, _vec(1)), _vec(10)))
    scaled = T.call_llvm_pure_intrin("int32x32", SCALE_HIGH, T.broadcast(recip, LANES), mant)
    shift = T.max(T.min(T.broadcast(x_exp + 54, LANES) - T.max(e5, _vec(1)), _vec(31)), _vec(1))
    magnitude = T.min(T.shift_right(scaled + T.shift_left(_vec(1), shift - _vec(1)), shift), _vec(127))
    neg = T.shift_right(T.shift_left(h, _vec(16)), _vec(31))
    return T.bitwise_xor(magnitude, neg) - neg


def _q8_quads(codes, k0, col):
    """Rows k0 .. k0 + 3 of 128 q8 columns as 4 vectors of 32 columns, lane j of vector c holding the four codes
    of column col + 32 c + j (byte i: row k0 + i)."""
    rows = [T.reinterpret("int32x32", codes.vload([k0 + i, col], "int8x128")) for i in range(4)]
    pair01, pair23 = _shuffle(rows[1], rows[0], 1), _shuffle(rows[3], rows[2], 1)   # (k0, k0+1) per column
    low = _shuffle(_half(pair23, LOW), _half(pair01, LOW), 2)      # columns 0 .. 63
    high = _shuffle(_half(pair23, HIGH), _half(pair01, HIGH), 2)   # columns 64 .. 127
    return [_half(low, LOW), _half(low, HIGH), _half(high, LOW), _half(high, HIGH)]


def int8_matmul(fmt: str, k: int, n: int, prompt: bool) -> tirx.PrimFunc:
    """y[1, m, n] (fp16) = x[1, m, k] (fp16) @ W, W stored KN: q4 codes uint32 [k / 8, n] or q8 codes int8
    [k, n], fp16 scales [k / 32, n]; m = 1 (decode) or the symbolic prompt length (`prompt`), ROWS rows a pass."""
    q8 = fmt == "q8"
    cols = Q8_COLUMNS if q8 else Q4_COLUMNS
    if fmt not in ("q4", "q8") or k % GROUP or n % LANES or n < cols:
        raise ValueError(f"{fmt} HVX matmul needs k % {GROUP} == 0, n % {LANES} == 0, n >= {cols}: k={k}, n={n}")
    groups, vecs = k // GROUP, cols // LANES
    words = GROUP // 4                    # int8 activation words per group (4 bytes each)
    rows = ROWS if prompt else 1
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    code_shape, code_dtype = ((i64(k), i64(n)), "int8") if q8 else ((i64(k // 8), i64(n)), "uint32")
    blocks_n = -(-n // cols)

    headroom = max(1, (groups - 1).bit_length())   # bits kept free so that `groups` terms add without overflow

    @T.prim_func(private=True)
    def kernel(codes: T.Buffer(code_shape, code_dtype), scales: T.Buffer((i64(groups), i64(n)), "float16"),
               x: T.Buffer((i64(1), m, i64(k)), "float16"), y: T.Buffer((i64(1), m, i64(n)), "float16")):
        T.func_attr({"tirx.noalias": True, HAND_WRITTEN: True})
        padded = T.meta_var((m + rows - 1) // rows * rows)
        # q8: word w = the int8 activations of k = 4w .. 4w + 3; q4: words 2v / 2v + 1 = those of the even /
        # odd k of the code word v (k = 8v, 8v + 2, ... / 8v + 1, 8v + 3, ...), as the nibble masks split them
        xw = T.alloc_buffer((padded, k // 4), "int32")
        x_mant = T.alloc_buffer((padded, groups), "int32")       # activation step = x_mant x 2^x_exp, 16-bit x_mant
        x_exp = T.alloc_buffer((padded, groups), "int32")
        x_base = T.alloc_buffer((padded, groups), "int32")       # q4: -7 x the group's activation sum
        acc = T.alloc_buffer((rows * cols,), "int32")            # a group's dot products
        total = T.alloc_buffer((rows * cols,), "int32")          # the row's sum, in units of 2^(frame + headroom + 16)
        frame = T.alloc_buffer((rows * cols,), "int32")          # max over groups of weight + activation exponent
        w_mant = T.alloc_buffer((cols,), "int32")                # a group's weight scales: signed 11-bit mantissa
        w_exp = T.alloc_buffer((cols,), "int32")                 # ... and exponent (scale = w_mant x 2^w_exp)
        lanes = T.alloc_buffer((4 * LANES,), "int32")            # the weight vectors vrmpy takes (registers)
        amax = T.alloc_buffer((1,), "float32")
        a_bits = T.alloc_buffer((1,), "int32")
        recip = T.alloc_buffer((1,), "int32")                    # 2^45 / x_mant, for the activations' int8 steps
        q_lanes = T.alloc_buffer((LANES,), "int32")              # a group's int8 activations
        q_sum = T.alloc_buffer((1,), "int32")
        for r in range(padded):
            for g in range(groups):
                a_bits[0] = 0     # max |x| of the group as fp16 bits (their order is the values' order)
                if r < m:
                    for i in range(GROUP):
                        a_bits[0] = T.max(a_bits[0], T.bitwise_and(T.Cast("int32", T.reinterpret("uint16", x[0, r, g * GROUP + i])), 0x7FFF))
                amax[0] = f16_bits_to_f32(a_bits[0])
                bits = T.meta_var(T.reinterpret("int32", amax[0] / T.float32(127)))
                x_mant[r, g] = T.if_then_else(amax[0] > T.float32(0),
                                              T.shift_right(T.bitwise_or(T.bitwise_and(bits, 0x7FFFFF), 0x800000), 8), 0)
                x_exp[r, g] = T.bitwise_and(T.shift_right(bits, 23), 0xFF) - 142   # - 127 - 15
                recip[0] = T.if_then_else(x_mant[r, g] > 0, T.Cast("int32", T.float32(2.0 ** 45) / T.Cast("float32", x_mant[r, g])), 0)
                q_lanes[T.ramp(0, 1, LANES)] = _quantize(_scale_bits(x.vload([0, T.min(r, m - 1), g * GROUP], "float16x32")),
                                                         recip[0], x_exp[r, g])
                q_sum[0] = 0
                for w in range(words):
                    xw[r, g * words + w] = 0
                    for j in range(4):
                        kk = T.meta_var(4 * w + j if q8 else w // 2 * 8 + w % 2 + 2 * j)
                        xw[r, g * words + w] = T.bitwise_or(xw[r, g * words + w], T.shift_left(T.bitwise_and(q_lanes[kk], 0xFF), 8 * j))
                        q_sum[0] = q_sum[0] + q_lanes[kk]
                x_base[r, g] = T.int32(0) if q8 else q_sum[0] * -ZERO
        for rb in range(padded // rows):
            for cb in range(blocks_n):
                col = T.meta_var(T.min(cb * cols, n - cols))
                for i in T.unroll(rows * vecs):
                    frame[T.ramp(i * LANES, 1, LANES)] = _vec(-(1 << 20))
                    total[T.ramp(i * LANES, 1, LANES)] = _vec(0)
                for g in range(groups):     # the frame: every group's term is then a right shift away
                    for c in T.unroll(vecs):
                        e = T.meta_var(_scale_exp(scales.vload([g, col + c * LANES], "float16x32")))
                        for r in T.unroll(rows):
                            at = T.meta_var(T.ramp((r * vecs + c) * LANES, 1, LANES))
                            frame[at] = T.max(frame[at], e + T.broadcast(x_exp[rb * rows + r, g], LANES))
                for g in range(groups):
                    for r in T.unroll(rows):
                        for c in T.unroll(vecs):
                            acc[T.ramp((r * vecs + c) * LANES, 1, LANES)] = T.broadcast(x_base[rb * rows + r, g], LANES)
                    if q8:
                        for quad in range(words):
                            quads = T.meta_var(_q8_quads(codes, g * GROUP + 4 * quad, col))
                            lanes[T.ramp(0, 1, LANES)] = quads[0]
                            lanes[T.ramp(LANES, 1, LANES)] = quads[1]
                            lanes[T.ramp(2 * LANES, 1, LANES)] = quads[2]
                            lanes[T.ramp(3 * LANES, 1, LANES)] = quads[3]
                            for r in T.unroll(rows):
                                a = T.meta_var(T.broadcast(xw[rb * rows + r, g * words + quad], LANES))
                                for c in T.unroll(vecs):
                                    at = T.meta_var((r * vecs + c) * LANES)
                                    acc[T.ramp(at, 1, LANES)] = T.call_llvm_pure_intrin(
                                        "int32x32", VRMPY_BB_ACC, acc.vload([at], "int32x32"),
                                        lanes.vload([c * LANES], "int32x32"), a)
                    else:
                        for word in T.unroll(GROUP // 8):
                            v = T.meta_var(T.reinterpret("int32x32", codes.vload([g * (GROUP // 8) + word, col], "uint32x32")))
                            lanes[T.ramp(0, 1, LANES)] = T.bitwise_and(v, _vec(NIBBLES))                       # even k
                            lanes[T.ramp(LANES, 1, LANES)] = T.bitwise_and(T.shift_right(v, _vec(4)), _vec(NIBBLES))   # odd k
                            for r in T.unroll(rows):
                                for h in T.unroll(2):
                                    acc[T.ramp(r * LANES, 1, LANES)] = T.call_llvm_pure_intrin(
                                        "int32x32", VRMPY_ACC, acc.vload([r * LANES], "int32x32"),
                                        lanes.vload([h * LANES], "int32x32"), xw[rb * rows + r, g * words + 2 * word + h])
                    for c in T.unroll(vecs):
                        h16 = T.meta_var(_scale_bits(scales.vload([g, col + c * LANES], "float16x32")))
                        e5 = T.meta_var(T.bitwise_and(T.shift_right(h16, _vec(10)), _vec(31)))
                        mant = T.meta_var(T.bitwise_or(T.bitwise_and(h16, _vec(1023)), T.shift_left(T.min(e5, _vec(1)), _vec(10))))
                        neg = T.meta_var(T.shift_right(T.shift_left(h16, _vec(16)), _vec(31)))   # 0 or -1: the sign
                        w_mant[T.ramp(c * LANES, 1, LANES)] = T.bitwise_xor(mant, neg) - neg
                        w_exp[T.ramp(c * LANES, 1, LANES)] = T.max(e5, _vec(1)) - _vec(25)
                    # term = (dot x weight mantissa) x activation mantissa / 2^16, < 2^30 in magnitude, in units of
                    # 2^(weight exp + activation exp + 16); shifted into the frame and added
                    for r in T.unroll(rows):
                        for c in T.unroll(vecs):
                            at = T.meta_var((r * vecs + c) * LANES)
                            term = T.meta_var(T.call_llvm_pure_intrin(
                                "int32x32", SCALE_HIGH, acc.vload([at], "int32x32") * w_mant.vload([c * LANES], "int32x32"),
                                T.broadcast(x_mant[rb * rows + r, g], LANES)))
                            shift = T.meta_var(T.min(frame.vload([at], "int32x32") - w_exp.vload([c * LANES], "int32x32")
                                                     - T.broadcast(x_exp[rb * rows + r, g] - headroom, LANES), _vec(31)))
                            total[T.ramp(at, 1, LANES)] = total.vload([at], "int32x32") + T.shift_right(term, shift)
                for r in range(rows):
                    if rb * rows + r < m:
                        for c in T.unroll(vecs):
                            at = T.meta_var((r * vecs + c) * LANES)
                            y[0, rb * rows + r, T.ramp(col + c * LANES, 1, LANES)] = T.reinterpret("float16x32", T.Cast(
                                "uint16x32", _to_f16_bits(total.vload([at], "int32x32"),
                                                          frame.vload([at], "int32x32") + _vec(headroom + 16))))

    return kernel


# ------------------------------------------------------------------------------------ recognition
def _dequant_format(block) -> str | None:
    """"q4" / "q8" when the block stores the fused TE's fp16 dequantize of KN codes: (float16(nibble) - 7) x
    scale, or float16(int8 code) x scale."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Mul) or str(store.value.ty) != "float16":
        return None
    code, scale = store.value.a, store.value.b
    if not isinstance(scale, ir.expr.TensorLoad) or str(scale.ty) != "float16":
        return None
    if (isinstance(code, tirx.Sub) and isinstance(code.a, tirx.Cast) and isinstance(code.b, tirx.FloatImm)
            and float(code.b.value) == float(ZERO)):
        return "q4"
    if isinstance(code, tirx.Cast) and isinstance(code.value, ir.expr.TensorLoad) and str(code.value.ty) == "int8":
        return "q8"
    return None


def match_int8_matmul(func: tirx.PrimFunc) -> tuple[str, int, int, bool, tuple[str, ...]] | None:
    """(format, K, N, prompt, role of each parameter) when `func` is the build's fused fp16 KN dequantize +
    matmul of q4 / q8 codes, one token (x [1, 1, K]) or a prompt (x [1, m, K], m symbolic); None otherwise."""
    found = blocks(func)
    if len(found) != 2 or found[1].name_hint != "matmul" or len(func.params) != 4:
        return None
    fmt = _dequant_format(found[0])
    out = func.params[-1]
    if fmt is None or str(out.dtype) != "float16" or len(out.shape) != 3 or not isinstance(out.shape[2], tirx.IntImm):
        return None
    rows = out.shape[1]
    prompt = isinstance(rows, tirx.Var)
    if not prompt and not (isinstance(rows, tirx.IntImm) and int(rows) == 1):
        return None
    n, roles, by_role = int(out.shape[2]), [], {}
    for p in func.params[:-1]:
        dims = [int(d) if isinstance(d, tirx.IntImm) else None for d in p.shape]
        one_row = p.shape[1].same_as(rows) if prompt else dims[1] == 1
        if str(p.dtype) == "float16" and len(dims) == 3 and one_row:
            role = "x"
        elif str(p.dtype) == ("int8" if fmt == "q8" else "uint32") and len(dims) == 2:
            role = "codes"
        elif str(p.dtype) == "float16" and len(dims) == 2:
            role = "scales"
        else:
            return None
        roles.append(role)
        by_role[role] = dims
    if sorted(roles) != ["codes", "scales", "x"] or by_role["x"][0] != 1 or by_role["x"][2] is None:
        return None
    k = by_role["x"][2]
    per_word = 1 if fmt == "q8" else 8
    cols = Q8_COLUMNS if fmt == "q8" else Q4_COLUMNS
    if (k % GROUP or n % LANES or n < cols or by_role["codes"] != [k // per_word, n]
            or by_role["scales"] != [k // GROUP, n]):
        return None
    return fmt, k, n, prompt, (*roles, "out")


def int8_matmul_like(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, str] | None:
    """(this module's kernel with `func`'s parameter order and attributes, its rule) for a q4 / q8 decode GEMV or
    prefill matmul; None otherwise."""
    match = match_int8_matmul(func)
    if match is None:
        return None
    fmt, k, n, prompt, order = match
    kernel = int8_matmul(fmt, k, n, prompt)
    rule = (PREFILL_RULES if prompt else GEMV_RULES)[fmt]
    op_class = "dequant-matmul" if prompt else "dequant-gemv"
    return substitute(func, kernel, order, op_class).with_attr(HAND_WRITTEN, True), rule
