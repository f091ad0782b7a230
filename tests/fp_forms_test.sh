#!/usr/bin/env bash
# scripts/fp-forms.py on a small PTX and SASS written here: ptx-lines names each operand by
# its definer (vector elements x / y, an inline-asm block's f16 unpack, an fma's addend, a
# mul's factors) and groups kernels by dtype and form, so two contractions of one line are two
# rows; sass counts a·b − c·d's two forms, a division's dividend form and a split's low half
# (rounded product or fused); and every bad use is one line and exit 2.
# ptx-open lists the a·b ± c·d that nvcc left to ptxas.
# Usage: fp_forms_test.sh PYTHON SCRIPT
set -euo pipefail
py="$1"
script="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Two bf16 kernels that contract line 11 (x·x' + y·y') differently, one f16 kernel in the first
# form through an inline-asm unpack, and a line 12 that only one kernel has.
cat >"$work/k.ptx" <<'PTX'
.version 8.8
	.file	1 "/src/gpu/scan/k.cu"
	.file	2 "/src/gpu/tc/other.cuh"
.visible .entry _Z1aI13__nv_bfloat16Ev(
)
{
	.loc	1 10 3
	ld.shared.v2.f32 	{%f1, %f2}, [%r1];
	ld.shared.v2.f32 	{%f3, %f4}, [%r2];
	.loc	1 11 3
	mul.f32 	%f5, %f2, %f4;
	fma.rn.f32 	%f6, %f1, %f3, %f5;
	.loc	2 11 3
	mul.f32 	%f7, %f6, %f6;
	.loc	1 12 3
	add.f32 	%f8, %f6, 0f00000000;
}
.visible .entry _Z1bI13__nv_bfloat16Ev(
)
{
	.loc	1 10 3
	ld.shared.v2.f32 	{%f1, %f2}, [%r1];
	ld.shared.v2.f32 	{%f3, %f4}, [%r2];
	.loc	1 11 3
	mul.f32 	%f5, %f1, %f3;
	fma.rn.f32 	%f6, %f2, %f4, %f5;
	.loc	1 14 3
	mul.f32 	%f7, %f1, %f2;
	mul.f32 	%f8, %f3, %f4;
	sub.f32 	%f9, %f7, %f8;
	add.f32 	%f10, %f7, %f6;
}
.visible .entry _Z1cI6__halfEv(
)
{
	.loc	1 10 3
	ld.shared.u32 	%r5, [%r1];
	// begin inline asm
	{.reg .f16 low,high;
  mov.b32 {low,high},%r5;
  cvt.f32.f16 %f1, low;}
	// end inline asm
	// begin inline asm
	{.reg .f16 low,high;
  mov.b32 {low,high},%r5;
  cvt.f32.f16 %f2, high;}
	// end inline asm
	.loc	1 11 3
	mul.f32 	%f5, %f2, %f2;
	fma.rn.f32 	%f6, %f1, %f1, %f5;
}
PTX
out="$("$py" "$script" ptx-lines "$work/k.ptx" scan/k.cu 11 12 13)"
grep -qx '# .*: 3 kernels, lines 11 12 13 of scan/k.cu' <<<"$out" || fail "header: $out"
grep -qx 'line 11 bf16: 1 kernel: fma(x,x,mul<y\*y>) mul(y,y)' <<<"$out" ||
  fail "line 11, kernel a's form (y's product rounded, x's fused): $out"
grep -qx 'line 11 bf16: 1 kernel: fma(y,y,mul<x\*x>) mul(x,x)' <<<"$out" ||
  fail "line 11, kernel b's form in a row of its own: $out"
grep -qx 'line 11 f16: 1 kernel: fma(cvt(x),cvt(x),mul<cvt(y)\*cvt(y)>) mul(cvt(y),cvt(y))' \
  <<<"$out" || fail "line 11, the f16 unpack's low and high halves as x and y: $out"
grep -qx 'line 12 bf16: 1 kernel: add(fma<mul>,0)' <<<"$out" || fail "line 12: $out"
grep -qx 'line 13: no float op' <<<"$out" || fail "line 13: $out"
[[ "$(grep -c '^line 11' <<<"$out")" == 3 ]] || fail "other.cuh's line 11 was counted: $out"

# ptx-open: kernel b's line 14 leaves a·b − c·d to ptxas (the add of a product and an fma does
# not count); nothing else does.
out="$("$py" "$script" ptx-open "$work/k.ptx")"
grep -qx '# .*: 3 kernels; a·b ± c·d left to ptxas, by source line' <<<"$out" ||
  fail "ptx-open header: $out"
grep -qx '/src/gpu/scan/k.cu:14: sub of two products in 1 kernel' <<<"$out" ||
  fail "ptx-open's line 14: $out"
[[ "$(grep -vc '^#' <<<"$out")" == 1 ]] || fail "ptx-open listed more than line 14: $out"

# SASS: one function with A twice and each other form once, one with none.
cat >"$work/k.sass" <<'SASS'
	code for sm_90a
		Function : _Z1fv
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   FMUL R2, R3, R4 ;                      /* 0x0000000403027220 */
        /*0010*/                   FFMA R5, R6.reuse, R7, -R2 ;           /* 0x0000000706057223 */
        /*0020*/                   FMUL R8, R3, R4 ;                      /* 0x0000000403087220 */
        /*0030*/                   FFMA R9, -R6, R7, R8 ;                 /* 0x0000000706097223 */
        /*0038*/                   FFMA R17, R6, R7, -R8 ;                /* 0x0000000706117223 */
        /*0040*/                   FCHK P0, R5, R10 ;                     /* 0x0000000a05007302 */
        /*0050*/                   FMUL R11, R3, R4 ;                     /* 0x00000004030b7220 */
        /*0060*/                   F2FP.BF16.F32.PACK_AB R12, R11, R11 ;  /* 0x0000000b0b0c723e */
        /*0070*/                   IMAD.U32 R13, R12, 0x10000, RZ ;       /* 0x000100000c0d7824 */
        /*0080*/                   FADD R14, -R13, R11 ;                  /* 0x0000000b0d0e7221 */
        /*0090*/                   FFMA R15, R3, R4, -R13 ;               /* 0x00000004030f7223 */
        /*00a0*/                   F2FP.BF16.F32.PACK_AB R16, R14, R15 ;  /* 0x0000000f0e10723e */
		Function : _Z1gv
        /*0000*/                   FADD R1, R2, R3 ;                      /* 0x0000000302017221 */
SASS
out="$("$py" "$script" sass "$work/k.sass")"
grep -qx '# .*: 2 functions; sub A, sub B, div A, div B, split FADD, split FFMA' <<<"$out" ||
  fail "sass header: $out"
grep -qx ' *2 *1 *1 *0 *1 *1  _Z1fv' <<<"$out" || fail "sass counts of _Z1fv: $out"
grep -qx ' *0 *0 *0 *0 *0 *0  _Z1gv' <<<"$out" || fail "sass counts of _Z1gv: $out"

# sass-diff: OLD has four functions. NEW: _Z1fv with other registers (a loaded value's register
# reused for a result) and another branch target (same), _Z1gv with its integer address work
# changed but the same float and memory instructions (same arith), _Z1hv with the other product
# fused (DIFFERS, at the product: the loaded values are numbered v0 … v3; op shapes unequal),
# _Z1sv squaring the other loaded element (DIFFERS; op shapes equal),
# _Z1kv absent and _Z1mv new; the anonymous namespace's path hash is not a difference.
cat >"$work/old.sass" <<'SASS'
		Function : _Z1fv
        /*0000*/                   LDG.E.64 R2, desc[UR4][R8.64] ;        /* 0x0000000000000000 */
        /*0010*/                   LDG.E.64 R6, desc[UR4][R8.64+0x8] ;    /* 0x0000000000000000 */
        /*0020*/                   FMUL R4, R2, R3 ;                      /* 0x0000000403027220 */
        /*0030*/                   FFMA R5, R6.reuse, R7, -R4 ;           /* 0x0000000706057223 */
        /*0040*/               @P0 BRA 0x60 ;                             /* 0x0000000000000000 */
		Function : _ZN2m33gpu40_GLOBAL__N__fb0bf0f8_8_split_cu_bd5e9ebc3gv
        /*0000*/                   IMAD.WIDE.U32 R2, R1, 0x4, R8 ;        /* 0x0000000000000000 */
        /*0010*/                   LDG.E R5, desc[UR4][R2.64] ;           /* 0x0000000000000000 */
        /*0020*/                   FMUL R6, R5, R5 ;                      /* 0x0000000000000000 */
		Function : _Z1hv
        /*0000*/                   LDG.E.128 R4, desc[UR4][R8.64] ;       /* 0x0000000000000000 */
        /*0010*/                   FMUL R2, R6, R7 ;                      /* 0x0000000403027220 */
        /*0020*/                   FFMA R3, R4, R5, -R2 ;                 /* 0x0000000706057223 */
		Function : _Z1kv
        /*0000*/                   FADD R1, R2, R3 ;                      /* 0x0000000302017221 */
		Function : _Z1sv
        /*0000*/                   LDG.E.64 R2, desc[UR4][R8.64] ;        /* 0x0000000000000000 */
        /*0010*/                   FMUL R4, R2, R2 ;                      /* 0x0000000000000000 */
        /*0020*/                   STG.E desc[UR4][R8.64], R4 ;           /* 0x0000000000000000 */
SASS
cat >"$work/new.sass" <<'SASS'
		Function : _Z1fv
        /*0000*/                   LDG.E.64 R12, desc[UR4][R8.64] ;       /* 0x0000000000000000 */
        /*0010*/                   LDG.E.64 R2, desc[UR4][R8.64+0x8] ;    /* 0x0000000000000000 */
        /*0020*/                   FMUL R14, R12, R13 ;                   /* 0x0000000403027220 */
        /*0030*/                   FFMA R12, R2, R3, -R14 ;               /* 0x0000000706057223 */
        /*0040*/               @P0 BRA 0x90 ;                             /* 0x0000000000000000 */
		Function : _ZN2m33gpu40_GLOBAL__N__0123abcd_8_split_cu_77aa00ff3gv
        /*0000*/                   SHF.L.U32 R2, R1, 0x2, RZ ;            /* 0x0000000000000000 */
        /*0010*/                   LDG.E R5, desc[UR4][R2.64] ;           /* 0x0000000000000000 */
        /*0020*/                   FMUL R6, R5, R5 ;                      /* 0x0000000000000000 */
		Function : _Z1hv
        /*0000*/                   LDG.E.128 R4, desc[UR4][R8.64] ;       /* 0x0000000000000000 */
        /*0010*/                   FMUL R2, R4, R5 ;                      /* 0x0000000403027220 */
        /*0020*/                   FFMA R3, -R6, R7, R2 ;                 /* 0x0000000706057223 */
		Function : _Z1mv
        /*0000*/                   FADD R1, R2, R3 ;                      /* 0x0000000302017221 */
		Function : _Z1sv
        /*0000*/                   LDG.E.64 R2, desc[UR4][R8.64] ;        /* 0x0000000000000000 */
        /*0010*/                   FMUL R4, R3, R3 ;                      /* 0x0000000000000000 */
        /*0020*/                   STG.E desc[UR4][R8.64], R4 ;           /* 0x0000000000000000 */
SASS
rc=0
out="$("$py" "$script" sass-diff "$work/old.sass" "$work/new.sass")" || rc=$?
[[ $rc == 1 ]] || fail "sass-diff with differences: exit $rc (want 1): $out"
grep -qx 'same  _Z1fv' <<<"$out" || fail "sass-diff renamed registers: $out"
grep -qx 'same arith  _ZN2m33gpu(anonymous)3gv' <<<"$out" || fail "sass-diff address work: $out"
grep -qx 'DIFFERS at arithmetic instruction 1 of 3 / 3 (op shapes unequal): FMUL v4, v2, v3  |  FMUL v4, v0, v1  _Z1hv' \
  <<<"$out" || fail "sass-diff fused product: $out"
grep -q '^DIFFERS at arithmetic instruction 1 of 3 / 3 (op shapes equal): .*  _Z1sv$' <<<"$out" ||
  fail "sass-diff another element, the same shapes: $out"
grep -qx 'only in OLD  _Z1kv' <<<"$out" || fail "sass-diff removed function: $out"
grep -qx 'only in NEW  _Z1mv' <<<"$out" || fail "sass-diff added function: $out"
grep -qx '# DIFFERS: 2, only in NEW: 1, only in OLD: 1, same: 1, same arith: 1' <<<"$out" ||
  fail "sass-diff summary: $out"
out="$("$py" "$script" sass-diff "$work/old.sass" "$work/old.sass")" ||
  fail "sass-diff of a file with itself: not exit 0: $out"
grep -qx '# same: 5' <<<"$out" || fail "sass-diff of a file with itself: $out"

# Refusals: one line, "fp-forms.py: ...", exit 2.
refuse() {
  local what="$1" msg rc=0
  shift
  msg="$("$py" "$script" "$@" 2>&1)" || rc=$?
  [[ $rc == 2 ]] || fail "$what: exit $rc (want 2): $msg"
  [[ "$(grep -c . <<<"$msg")" == 1 && "$msg" == fp-forms.py:* ]] ||
    fail "$what: not one fp-forms.py line: $msg"
}
printf '\t.file\t1 "/src/empty.cu"\n' >"$work/empty.ptx"
refuse "no command"
refuse "an unknown command" dump "$work/k.ptx"
refuse "a missing PTX" ptx-lines "$work/none.ptx" scan/k.cu 11
refuse "a source the PTX does not name" ptx-lines "$work/k.ptx" scan/other.cu 11
refuse "a line that is not a number" ptx-lines "$work/k.ptx" scan/k.cu eleven
refuse "a PTX without a kernel" ptx-lines "$work/empty.ptx" empty.cu 1
[[ "$("$py" "$script" ptx-lines "$work/empty.ptx" empty.cu 1 2>&1)" == *"no kernel"* ]] ||
  fail "a PTX without a kernel: not said"
refuse "no line" ptx-lines "$work/k.ptx" scan/k.cu
refuse "a missing SASS" sass "$work/none.sass"
refuse "ptx-open without its PTX" ptx-open
refuse "a PTX without a kernel, ptx-open" ptx-open "$work/empty.ptx"
refuse "a SASS without a function" sass "$work/empty.ptx"
refuse "sass-diff with one file" sass-diff "$work/old.sass"
refuse "sass-diff with a missing file" sass-diff "$work/old.sass" "$work/none.sass"
refuse "sass-diff of a file without a function" sass-diff "$work/old.sass" "$work/empty.ptx"
echo "fp_forms_test: all checks passed"
