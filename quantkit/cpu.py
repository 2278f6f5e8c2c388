"""What numba-compiled code may use of the CPU: the instruction-set features of the target numba
compiles for, which is not always the host.

numba's JIT compiles for the CPU named by NUMBA_CPU_NAME / NUMBA_CPU_FEATURES where they are set
(``NUMBA_CPU_NAME=generic``, common for portable caches, is x86-64's baseline: SSE2, no SSSE3, AVX2,
F16C or FMA), for the host otherwise.  The kernels written as LLVM IR (runtime/dot.py,
kernels/kt.py) may emit an x86 intrinsic only where that target has it: LLVM aborts the whole
process on one it cannot select ("Cannot select: X86ISD::VPMADDUBSW"), and a float16 ``fpext``
without F16C becomes a call to a helper the JIT does not resolve (a segfault).

The answer comes from LLVM itself, for numba's own target (the CPU name and feature string its
code generator was created with: ``magic_tuple``, also the key of numba's on-disk cache, so a
cached kernel always matches the choice made here): a few functions in plain IR are compiled to
assembly, and the instructions LLVM selects for them say what the target has.  No table of CPU
names, and nothing is read from the host's cpuid.

An edit here, as of dot.py's IR, makes numba recompile the kernels it has cached: their cache is
keyed on all of quantkit's sources (quantkit/kernel_cache.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import llvmlite.binding as llb
from llvmlite import ir


@dataclass(frozen=True)
class Target:
    """The features of the target that numba compiles for, as the kernels use them."""
    triple: str
    cpu: str
    sse2: bool          # pmaddwd on 128 bits (x86; all of x86-64)
    ssse3: bool         # pshufb, pmaddubsw, psignb on 128 bits (x86)
    avx2: bool          # the same, and integer ops, on 256 bits (x86)
    f16c: bool          # float16 -> float32 in hardware (vcvtph2ps on x86; native elsewhere)
    fma: bool           # fused multiply-add instructions (no kernel's result depends on it: the
                        # kernels' multiply-adds are llvm.fma, libm's exact fmaf without FMA)
    avx512: bool        # 512-bit registers (AVX-512F)
    avx512bw: bool = False  # byte and word ops on 512 bits (AVX-512BW: vpshufb, vpabsb, vpmovb2m on zmm)
    vnni: bool = False      # vpdpbusd on 256 bits (AVX-512 VNNI with VL, or AVX-VNNI): unsigned x signed
                            # bytes, 4 at a time, added into 32-bit lanes, without pmaddubsw's saturation
    gfni: bool = False      # vgf2p8affineqb (GFNI with AVX): any bit matrix applied to every byte,
                            # one matrix per 64-bit lane (shift, mask and move bits in one instruction)

    @property
    def x86(self) -> bool:
        return _is_x86(self.triple)


def _is_x86(triple: str) -> bool:
    return triple.split("-")[0] in ("x86_64", "i386", "i686")


# One probe function per feature, in plain IR that every target compiles; the instruction LLVM
# selects for it shows whether the target has the feature (see _features).  The byte permutation
# is one that SSE2's word shuffles cannot do: pshufb where there is SSSE3.  SSE2, AVX2 and AVX-512
# are probed by one integer add of 128, 256 and 512 bits.
_VECTOR_ADD = """
define void @probe_{name}(<{lanes} x i32>* %p, <{lanes} x i32>* %q) {{
  %a = load <{lanes} x i32>, <{lanes} x i32>* %p, align 4
  %b = load <{lanes} x i32>, <{lanes} x i32>* %q, align 4
  %s = add <{lanes} x i32> %a, %b
  store <{lanes} x i32> %s, <{lanes} x i32>* %p, align 4
  ret void
}}
"""
_PROBES = r"""
define void @probe_f16c(<8 x half>* %p, <8 x float>* %q) {
  %h = load <8 x half>, <8 x half>* %p, align 2
  %f = fpext <8 x half> %h to <8 x float>
  store <8 x float> %f, <8 x float>* %q, align 4
  ret void
}
define void @probe_ssse3(<16 x i8>* %p) {
  %v = load <16 x i8>, <16 x i8>* %p, align 1
  %w = shufflevector <16 x i8> %v, <16 x i8> undef, <16 x i32> <BYTE_PERMUTATION>
  store <16 x i8> %w, <16 x i8>* %p, align 1
  ret void
}
declare float @llvm.fma.f32(float, float, float)
define float @probe_fma(float %a, float %b, float %c) {
  %r = call float @llvm.fma.f32(float %a, float %b, float %c)
  ret float %r
}
declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)
define i32 @probe_vnni(<32 x i8>* %p, <32 x i8>* %q) {
  %a = load <32 x i8>, <32 x i8>* %p, align 1
  %b = load <32 x i8>, <32 x i8>* %q, align 1
  %u = zext <32 x i8> %a to <32 x i32>
  %s = sext <32 x i8> %b to <32 x i32>
  %m = mul <32 x i32> %u, %s
  %r = call i32 @llvm.vector.reduce.add.v32i32(<32 x i32> %m)
  ret i32 %r
}
declare <32 x i8> @llvm.bitreverse.v32i8(<32 x i8>)
define void @probe_gfni(<32 x i8>* %p) {
  %a = load <32 x i8>, <32 x i8>* %p, align 1
  %r = call <32 x i8> @llvm.bitreverse.v32i8(<32 x i8> %a)
  store <32 x i8> %r, <32 x i8>* %p, align 1
  ret void
}
define void @probe_avx512bw(<64 x i8>* %p, <64 x i8>* %q) {
  %a = load <64 x i8>, <64 x i8>* %p, align 1
  %b = load <64 x i8>, <64 x i8>* %q, align 1
  %s = add <64 x i8> %a, %b
  store <64 x i8> %s, <64 x i8>* %p, align 1
  ret void
}
""".replace("BYTE_PERMUTATION", ", ".join(f"i32 {i}" for i in (15, 3, 14, 2, 13, 1, 12, 0, 11, 7, 10, 6, 9, 5, 8, 4))) \
    + "".join(_VECTOR_ADD.format(name=name, lanes=lanes) for name, lanes in (("sse2", 4), ("avx2", 8), ("avx512", 16)))


def _functions(asm: str) -> dict[str, list[str]]:
    """The instruction lines of each probe function in LLVM's assembly listing."""
    out, current = {}, None
    for line in asm.splitlines():
        name = line.strip().rstrip(":")
        if line and not line[0].isspace() and line.rstrip().endswith(":") and name.startswith("probe_"):
            current = out.setdefault(name[len("probe_"):], [])
        elif current is not None and line.startswith("\t") and not line.lstrip().startswith((".", "#")):
            current.append(line.strip())
    return out


def _features(triple: str, cpu: str, features: str) -> Target:
    llb.initialize_native_target()
    llb.initialize_native_asmprinter()
    tm = llb.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=2)
    module = llb.parse_assembly(_PROBES)
    module.triple = tm.triple
    fn = _functions(tm.emit_assembly(module))
    x86 = _is_x86(triple)

    def uses(name, *needles):
        return any(all(n in line for n in needles) for line in fn[name])
    # float16 widening is native unless LLVM calls a library helper for it (__extendhfsf2, or
    # __gnu_h2f_ieee before LLVM 15): x86 without F16C
    f16_native = not any(h in line for line in fn["f16c"] for h in ("__extendhfsf2", "__gnu_h2f_ieee", "call"))
    return Target(triple=triple, cpu=cpu,
                  sse2=x86 and uses("sse2", "paddd", "%xmm"),
                  ssse3=x86 and uses("ssse3", "pshufb"),
                  avx2=x86 and uses("avx2", "vpaddd", "%ymm"),
                  f16c=f16_native,
                  fma=uses("fma", "fmadd"),
                  avx512=x86 and uses("avx512", "%zmm"),
                  # bytes added in one zmm instruction (AVX-512F alone adds them as two ymm halves)
                  avx512bw=x86 and uses("avx512bw", "vpaddb", "%zmm"),
                  # a sum of unsigned-by-signed byte products, which LLVM selects as vpdpbusd where
                  # the target has VNNI (AVX-512 VNNI or AVX-VNNI: both have the 256-bit form)
                  vnni=x86 and uses("vnni", "vpdpbusd", "%ymm"),
                  # a bit reversal of 32 bytes, which LLVM selects as one vgf2p8affineqb on a ymm
                  # register where the target has GFNI and AVX
                  gfni=x86 and uses("gfni", "vgf2p8affineqb", "%ymm"))


@functools.cache
def target() -> Target:
    """The features of numba's JIT target in this process (fixed once numba has started)."""
    from numba.core.registry import cpu_target
    triple, cpu, features = cpu_target.target_context.codegen().magic_tuple()
    return _features(triple, cpu, features)


# ---- IR that depends on the target ----

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


def half_to_float(builder: ir.IRBuilder, h: ir.Value, hardware: bool | None = None) -> ir.Value:
    """float16 values as float32: h a half or <n x half>, or their bits as i16 / <n x i16>.

    One ``fpext`` where the target widens halves itself (F16C; ``hardware``: the target's answer
    unless given); elsewhere exactly the same bits in integer arithmetic, with the bits
    u = s eeeee mmmmmmmmmm:

        normal      e != 0, 31   (u & 0x7fff) << 13 moves exponent and mantissa into place; the
                                 exponent's bias 15 becomes 127: + (127 - 15) << 23
        inf, NaN    e == 31      exponent 255: + (255 - 31) << 23, and a NaN made quiet (bit 22
                                 set, as vcvtph2ps does: numpy's table keeps a signalling NaN's bit)
        zero, sub   e == 0       m * 2^-24 (m < 1024: exact as a float32 product, and a normal
                                 float32, so flushing denormals cannot touch it)
        and the sign bit s << 16 over all of them."""
    vec = isinstance(h.type, ir.VectorType)
    n = h.type.count if vec else 1

    def like(t):
        return ir.VectorType(t, n) if vec else t

    def const(t, v):
        return ir.Constant(like(t), [v] * n if vec else v)
    elt = h.type.element if vec else h.type
    if hardware is None:
        hardware = target().f16c
    if hardware:
        half = h if isinstance(elt, ir.HalfType) else builder.bitcast(h, like(ir.HalfType()))
        return builder.fpext(half, like(_F32))
    bits = builder.bitcast(h, like(_I16)) if isinstance(elt, ir.HalfType) else h
    u = builder.zext(bits, like(_I32))
    sign = builder.shl(builder.and_(u, const(_I32, 0x8000)), const(_I32, 16))
    exp = builder.and_(u, const(_I32, 0x7C00))
    mant = builder.and_(u, const(_I32, 0x03FF))
    placed = builder.shl(builder.and_(u, const(_I32, 0x7FFF)), const(_I32, 13))
    normal = builder.add(placed, const(_I32, (127 - 15) << 23))
    quiet = builder.select(builder.icmp_unsigned("!=", mant, const(_I32, 0)), const(_I32, 1 << 22), const(_I32, 0))
    special = builder.or_(builder.add(placed, const(_I32, (255 - 31) << 23)), quiet)
    small = builder.bitcast(builder.fmul(builder.sitofp(mant, like(_F32)), const(_F32, 2.0 ** -24)), like(_I32))
    magnitude = builder.select(builder.icmp_unsigned("==", exp, const(_I32, 0)), small,
                               builder.select(builder.icmp_unsigned("==", exp, const(_I32, 0x7C00)), special, normal))
    return builder.bitcast(builder.or_(magnitude, sign), like(_F32))
