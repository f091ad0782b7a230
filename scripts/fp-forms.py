#!/usr/bin/env python3
"""Which rounding each floating-point expression got, per kernel instantiation.

The GPU tests hold some kernels bit for bit against others (wgmma against mma.sync, a fused tail
against the stage kernels, a staged load against a global one). Where two instantiations inline
one source expression with two products, the compiler fuses one of them into an fma and rounds
the other, and it need not choose alike in each: nvcc decides for `a*b + c*d` (visible in the
PTX), ptxas for what nvcc leaves as mul, mul, sub (visible only in the SASS);
docs/log/PERF-history.md records the cases found. This script reads both, so that a pin
(`__fmaf_rn` / `__fmul_rn`) can be written as the form every instantiation already has, and
the instantiations whose forms differ can be named.

  fp-forms.py ptx-lines PTX SRC LINE...
      PTX from `nvcc -ptx -lineinfo` (the build's flags: build-gpu/compile_commands.json).
      For each LINE of the source file whose path ends in SRC, the float ops (mul, fma, add,
      sub, neg) that the innermost .loc attributes to that line, each operand named by what
      defines it: x / y for the first / second element of a vector load or unpack, acc for an
      mma/wgmma accumulator (E/O: even or odd element), cvt(...) for a conversion, fma<...>
      with the fma's addend, mul<a*b> with its factors. One row per (line, dtype, set of
      forms) with the number of kernels: a line whose dtype has one row is contracted alike
      in every instantiation.
  fp-forms.py ptx-open PTX
      The expressions nvcc left to ptxas: every add.f32 / sub.f32 whose two operands are both
      mul.f32 results (a·b ± c·d, uncontracted), by source file and line (innermost .loc), with
      the number of kernels holding one. ptxas fuses one of the two products, and which one is
      in the SASS only; a line listed here in code that tests compare bit for bit across
      instantiations is one to read with `sass` and pin.
  fp-forms.py sass SASS
      SASS from `cuobjdump -sass OBJ` (on the GPU machine, or here after
      scripts/fetch-sass-tools.sh: .sass-tools/bin/cuobjdump).
      Per function: sub A / B, the FFMAs of one negated operand whose addend is an FMUL
      (A: FFMA(a, b, -FMUL(c, d)), the first product of a*b - c*d fused; B: FFMA(-c, d,
      FMUL(a, b)), the second); div A / B, the same for the dividends of IEEE divisions (FCHK's
      operand); split FADD / FFMA, the low halves of bf16/f16 hi/lo splits (F2FP packs of
      v - hi): FADD where the product v was rounded first, FFMA where it was fused into the
      subtraction. A function with both A and B, or forms unlike its siblings', is where a pin
      changes bits. (Functions are named as in sass-diff: an anonymous namespace as
      `(anonymous)`.)
  fp-forms.py sass-diff OLD NEW
      Two `cuobjdump -sass` of one source before and after a change (a pin that should keep
      the bits; scripts/sass-diff.sh makes them). Per function of either:
        same        the whole instruction stream equal with every register value named by
                    its definition (v0, v1, … in order) and branch targets numbered: the same
                    code up to register allocation, so the same bits;
        same arith  the float, half, MUFU, tensor-core, memory and branch instructions equal,
                    either in the same order or as the same dataflow (each value named by a
                    hash of the computation that made it, a product's factors and a sum's
                    terms in one order, a negated factor as a negated product), with the
                    integer work that feeds them named by its computation and the addresses
                    not compared: ptxas placed the integer work differently;
        DIFFERS     not shown equal, with the first arithmetic instruction that differs in
                    order, and whether the op shapes are equal (the multiset of float,
                    tensor-core and memory opcodes with each operand's sign, absolute value
                    or immediate: equal points at scheduling, unequal at changed arithmetic). The dataflow does not follow loops (a use names the latest
                    definition above it in the listing), so a rescheduled loop is often
                    DIFFERS with the same bits: read the two listings there;
        only in OLD / only in NEW.
      Anonymous namespaces (named after the source path) are compared as one. Exit status 1
      where any function differs or is on one side only.

Bad use (an unknown command, a missing file, a file with no kernel or function): one line on
stderr and exit status 2.
"""
import collections
import hashlib
import re
import signal
import sys


def die(msg):
    print(f"fp-forms.py: {msg}", file=sys.stderr)
    sys.exit(2)


def read_lines(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        die(f"cannot read {path}: {e.strerror}")


# ---- PTX ------------------------------------------------------------------------------------

OP = re.compile(r"^(@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);$")
VEC_DEST = re.compile(r"^([a-z][\w.]*)\s+\{([^}]*)\}")
FLOAT_OP = re.compile(r"^(mul|fma|add|sub|neg)\.(rn\.)?f32$")


def dtype_of(kernel):
    if "13__nv_bfloat16" in kernel:
        return "bf16"
    if "6__half" in kernel:
        return "f16"
    return "f32"


def ptx_file_table(text):
    """The .file table: number -> path (with -lineinfo it may follow the kernels)."""
    files = {}
    for t in text:
        m = re.match(r'\s*\.file\s+(\d+)\s+"([^"]*)"', t)
        if m:
            files[m.group(1)] = m.group(2)
    return files


def ptx_walk(path, text):
    """Every instruction of every kernel, in order: (kernel, loc, op, regs, defs), loc the
    innermost .loc as (file number, line) or None, defs the kernel's definitions so far
    (register -> (op, args)), updated after the instruction is yielded. Vector destinations and
    an inline-asm block's unpack name each element by its position (op.c0, op.c1, ...).
    Refuses a PTX without a kernel."""
    kernel, loc, defs, kernels = None, None, {}, 0
    for raw in text:
        s = raw.strip()
        if s.startswith((".visible .entry", ".entry")):
            m = re.search(r"(_Z\w+)", s)
            kernel, loc, defs = (m.group(1) if m else s), None, {}
            kernels += 1
            continue
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)", s)
        if m:
            loc = (m.group(1), int(m.group(2)))
            continue
        # Inline asm: "{ op ...;}" on one line, or a block "{.reg .f16 low,high;" … "op ...;}"
        # whose block-local registers (low, high) are named by the mov that unpacks them.
        if s.startswith("{"):
            s = s[1:].strip()
        if s.endswith("}"):
            s = s[:-1].strip()
        if kernel is None:
            continue
        v = VEC_DEST.match(s)
        if v:  # a vector destination: each element named by its position
            base = v.group(1).split(".")[0]
            for i, r in enumerate(x.strip() for x in v.group(2).split(",")):
                defs[r] = (f"{base}.c{i}", "")
            continue
        m = OP.match(s)
        if not m:
            continue
        op, args = m.group(2), m.group(3)
        regs = [a.strip() for a in args.split(",")]
        yield kernel, loc, op, regs, defs
        if regs and regs[0].startswith("%"):
            defs[regs[0]] = (op, args)
    if kernels == 0:
        die(f"{path}: no kernel (.entry) in the PTX")


def operand_kind(defs, reg, depth=0):
    """What defines reg, as ptx-lines prints it."""
    d = defs.get(reg)
    if d is None:
        return reg if not reg.startswith("%") else "in"
    op, args = d
    m = re.search(r"\.c(\d+)$", op)
    if m:
        base = op[: m.start()]
        if base in ("mma", "wgmma"):
            return "acc" + ("E" if int(m.group(1)) % 2 == 0 else "O")
        return {0: "x", 1: "y"}.get(int(m.group(1)), "c" + m.group(1))
    a = [x.strip() for x in args.split(",")]
    if op.startswith("cvt.f32.") and depth < 2:
        return "cvt(" + operand_kind(defs, a[1], depth + 1) + ")"
    if op.startswith("mov.b32") and len(a) == 2 and depth < 2:
        return operand_kind(defs, a[1], depth + 1)
    if op.startswith("mul") and depth < 1:
        return ("mul<" + operand_kind(defs, a[1], depth + 1) + "*" +
                operand_kind(defs, a[2], depth + 1) + ">")
    if op.startswith("fma") and depth < 2:
        return "fma<" + operand_kind(defs, a[3], depth + 1) + ">"
    return op.split(".")[0]


def ptx_lines(path, src, lines):
    text = read_lines(path)
    files = {k: v for k, v in ptx_file_table(text).items() if v.endswith(src)}
    if not files:
        die(f"{path}: no .file ends in {src} (was the PTX made with -lineinfo?)")
    want = set(lines)
    found = collections.OrderedDict()  # (kernel, line) -> [ops]
    kernels = set()
    for kernel, loc, op, regs, defs in ptx_walk(path, text):
        kernels.add(kernel)
        if loc and loc[0] in files and loc[1] in want and FLOAT_OP.match(op):
            form = op.split(".")[0] + "(" + ",".join(operand_kind(defs, r) for r in regs[1:]) + ")"
            found.setdefault((kernel, loc[1]), []).append(form.replace("0f00000000", "0"))
    rows = collections.Counter()
    for (kernel, line), forms in found.items():
        rows[(line, dtype_of(kernel), " ".join(sorted(set(forms))))] += 1
    print(f"# {path}: {len(kernels)} kernels, lines {' '.join(str(x) for x in lines)} of {src}")
    for line in lines:
        mine = [(k, n) for k, n in rows.items() if k[0] == line]
        if not mine:
            print(f"line {line}: no float op")
        for (_, dt, forms), n in sorted(mine):
            print(f"line {line} {dt}: {n} kernel{'s' if n != 1 else ''}: {forms}")


def ptx_open(path):
    text = read_lines(path)
    files = ptx_file_table(text)
    hits = collections.Counter()  # (file, line, op) -> kernels
    kernels, seen = set(), set()
    for kernel, loc, op, regs, defs in ptx_walk(path, text):
        kernels.add(kernel)
        if re.match(r"^(add|sub)\.f32$", op) and len(regs) == 3 and all(
                defs.get(r, ("",))[0].startswith("mul.") for r in regs[1:]):
            # Without -lineinfo there is no .loc: the hits are counted under "?:0".
            key = (files.get(loc[0], "?") if loc else "?", loc[1] if loc else 0,
                   op.split(".")[0])
            if (kernel, key) not in seen:
                seen.add((kernel, key))
                hits[key] += 1
    print(f"# {path}: {len(kernels)} kernels; a·b ± c·d left to ptxas, by source line")
    for (f, line, op), n in sorted(hits.items()):
        print(f"{f}:{line}: {op} of two products in {n} kernel{'s' if n != 1 else ''}")


# ---- SASS -----------------------------------------------------------------------------------

INS = re.compile(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+([^;]*);")
REG = re.compile(r"-?R\d+$")


def sub_form(op, args, last):
    """'A' for FFMA(a, b, -FMUL(c, d)), 'B' for FFMA(-c, d, FMUL(a, b)) (one negated operand,
    the addend an FMUL result), else ''."""
    if op != "FFMA" or len(args) != 4 or not all(REG.match(a) for a in args[1:]):
        return ""
    negs = [a.startswith("-") for a in args[1:]]
    if sum(negs) != 1 or last.get(args[3].lstrip("-"), ("",))[0] != "FMUL":
        return ""
    return "A" if negs[2] else "B"


def sass(path):
    res = collections.OrderedDict()
    for fn, ins in sass_functions(path).items():
        last, c = {}, collections.Counter()
        res[fn] = c
        for _, op, args in ins:
            form = sub_form(op, args, last)
            if form:
                c["sub " + form] += 1
            elif op == "FCHK" and len(args) >= 2:
                d = last.get(args[1].lstrip("-"))
                if d and d[0] == "FFMA" and d[2]:
                    c["div " + d[2]] += 1
            elif op.startswith("F2FP") and "PACK_AB" in op:
                for a in args[1:3]:
                    d = last.get(a.lstrip("-"))
                    if not d:
                        continue
                    if d[0] == "FADD" and any(x.startswith("-R") for x in d[1][1:]):
                        c["split FADD"] += 1
                    elif d[0] == "FFMA" and len(d[1]) == 4 and d[1][3].startswith("-R"):
                        c["split FFMA"] += 1
            if args and re.match(r"R\d+$", args[0]):
                last[args[0]] = (op, args, form)
    keys = ["sub A", "sub B", "div A", "div B", "split FADD", "split FFMA"]
    print(f"# {path}: {len(res)} functions; " + ", ".join(keys))
    for f, c in res.items():
        print(" ".join(f"{c[k]:4d}" for k in keys) + "  " + f)


# What an arithmetic comparison keeps: float, half and tensor-core work, memory, and the
# branches (so that a changed loop bound or condition is seen). HFMA2.MMA is a move.
ARITH = re.compile(r"(?!HFMA2\.MMA|LDC)(F|H|MUFU|LD|ST|RED|ATOM|SHFL|I2F|F2I|BRA|EXIT|CALL|RET)")
REGTOK = re.compile(r"\b(?:U?R(?!Z)\d+|U?P(?!T)\d+)\b")
NO_DEST = re.compile(r"(ST|RED|BRA|JMP|EXIT|BAR|BSYNC|WARPSYNC|NOP|CALL|RET|SYNCS|MEMBAR|FENCE|"
                     r"ERRBAR|CCTL|DEPBAR|WARPGROUP|UTMA|UBLKCP|ARRIVES|YIELD|BPT|KILL)")
JUMP = re.compile(r"(BRA|JMP|CALL|BSSY|BREAK|BMOV)")
PRED = re.compile(r"!?U?P(\d+|T)$")


def anon_free(name):
    """name with each anonymous namespace (its mangled length, then _GLOBAL__N_ and a hash of
    the source path: another checkout compiles it under another name) as `(anonymous)`."""
    out, i = [], 0
    for m in re.finditer(r"(\d+)_GLOBAL__N_", name):
        if m.start() < i:
            continue
        n = int(m.group(1))
        start = m.start(1) + len(m.group(1))
        out.append(name[i:m.start()] + "(anonymous)")
        i = start + n
    return "".join(out) + name[i:]


def dest_width(op):
    """Registers an instruction writes from its first operand on."""
    m = re.match(r"HGMMA\.64x(\d+)x\d+\.(F32|F16)", op)
    if m:
        return int(m.group(1)) // (2 if m.group(2) == "F32" else 4)
    if op.startswith("HMMA."):
        return 4 if ".F32" in op else 2
    m = re.match(r"LDSM\..*\.(\d)$", op)
    if m:
        return int(m.group(1))
    if ".128" in op:
        return 4
    if ".64" in op or ".WIDE" in op:
        return 2
    return 1


def sass_functions(path):
    """{function: [(guard, opcode, [operands])]} of a cuobjdump -sass listing, in order."""
    funcs, fn = collections.OrderedDict(), None
    for line in read_lines(path):
        if "Function :" in line:
            fn = anon_free(line.split("Function :", 1)[1].strip())
            funcs[fn] = []
            continue
        m = INS.search(line)
        if m and fn is not None:
            args = [x.strip() for x in m.group(3).replace(".reuse", "").split(",")] if m.group(3).strip() else []
            funcs[fn].append(((m.group(1) or "").strip(), m.group(2), args))
    if not funcs:
        die(f"{path}: no function (a 'Function :' line of cuobjdump -sass)")
    return funcs


def destinations(op, args):
    """The registers an instruction writes: per leading operand it writes (none, one, or a value
    and a predicate), the registers that operand covers (several for an HGMMA, an HMMA, an LDSM
    or a .64/.128 access; none for a written operand that is no register, RZ or PT)."""
    n = 0
    if not NO_DEST.match(op) and args and REGTOK.fullmatch(args[0]):
        n = 2 if len(args) >= 3 and PRED.match(args[1]) else 1
    dests = []
    for k in range(n):
        m = re.fullmatch(r"(U?[RP])(\d+)", args[k])
        if not m:
            dests.append([])
            continue
        kind, i = m.group(1), int(m.group(2))
        width = dest_width(op) if k == 0 and kind in ("R", "UR") else 1
        dests.append([f"{kind}{i + j}" for j in range(width)])
    return dests


def named(val, text):
    """text with each register read replaced by its value's name in val (`in` and the register
    where nothing above defined it)."""
    return REGTOK.sub(lambda m: val.get(m.group(0), "in" + m.group(0)), text)


def canonical(ins, keep=None):
    """The instructions as text with every register value named by its definition, so that two
    register allocations of the same values give the same text: a kept instruction's results
    are v0, v1, … in order; a result of an instruction not kept (keep(op) false: the integer
    work of an arithmetic comparison) is named by a hash of its operation and operands' names
    (the same computation, the same name); a register read before any definition is `in` and
    its name. With keep, kept memory operands read `[addr]` (addresses are not compared).
    Branch targets are numbered in order of first use; other immediates stay as written."""
    val, labels, out, n = {}, {}, [], 0
    for guard, op, args in ins:
        dests = destinations(op, args)
        srcs = [named(val, x) for x in args[len(dests):]]
        if JUMP.match(op):
            srcs = [re.sub(r"\b0x[0-9a-f]+\b",
                           lambda m: "L" + str(labels.setdefault(m.group(0), len(labels))), x)
                    for x in srcs]
        text_in = " ".join(x for x in (named(val, guard), op, ", ".join(srcs)) if x)
        if keep is not None and not keep(op):
            h = hashlib.sha1(text_in.encode()).hexdigest()[:10]
            for k, regs in enumerate(dests):
                for j, r in enumerate(regs):
                    val[r] = f"e{h}.{k}.{j}"
            continue
        if keep is not None:
            srcs = [re.sub(r"\[[^\]]*\]", "[addr]", x) for x in srcs]
        shown = []
        for k, regs in enumerate(dests):
            for r in regs:
                val[r] = f"v{n}"
                n += 1
            shown.append(val[regs[0]] if regs else args[k])
        out.append(" ".join(x for x in (named(val, guard), op, ", ".join(shown + srcs)) if x))
    return out


def commuted(op, srcs):
    """srcs in one order for a commutative operation, and a product's sign on the product: a
    product's two factors sorted, with a negation of either moved in front ((-a)·b = a·(-b) =
    -(a·b) exactly); an addition's or min/max's two operands sorted."""
    base = op.split(".")[0]
    if base in ("FMUL", "FFMA", "HMUL2", "HFMA2", "DMUL", "DFMA") and len(srcs) >= 2:
        neg = sum(x.startswith("-") for x in srcs[:2]) % 2
        pair = sorted(x.lstrip("-") for x in srcs[:2])
        return [("-" if neg else "") + "*".join(pair)] + srcs[2:]
    if base in ("FADD", "HADD2", "DADD", "FMNMX") and len(srcs) >= 2:
        return sorted(srcs[:2]) + srcs[2:]
    return srcs


def dataflow(ins, keep):
    """The kept instructions as a sorted list of texts in which every register value is named by
    a hash of the computation that made it (operation, operands' names, immediates, addresses),
    so the list does not depend on the order ptxas scheduled them in, nor on its registers. A
    use names the latest definition before it in the listing (loops are not followed)."""
    val, out = {}, []
    for guard, op, args in ins:
        dests = destinations(op, args)
        srcs = [named(val, x) for x in args[len(dests):]]
        if JUMP.match(op):
            srcs = ["target"] * len(srcs)
        srcs = commuted(op, srcs)
        text = " ".join(x for x in (named(val, guard), op, ", ".join(srcs)) if x)
        h = hashlib.sha1(text.encode()).hexdigest()[:12]
        for k, regs in enumerate(dests):
            for j, r in enumerate(regs):
                val[r] = f"{h}.{k}.{j}"
        if keep(op):
            out.append(f"{text} -> {h}" if dests else text)
    return sorted(out)


def op_shapes(ins):
    """The float, tensor-core and memory instructions as a multiset of shapes: opcode and, per
    source operand, whether it is negated, an absolute value or an immediate (a product's sign
    on the product, as in commuted). Equal shapes with a
    DIFFERS verdict point at scheduling (the same operations, placed or fed otherwise); unequal
    shapes at changed arithmetic."""
    def shape(x):
        return (("-" if x.startswith("-") else "") + ("|" if "|" in x else "")
                + ("imm" if not REGTOK.search(x) and x not in ("RZ", "PT", "URZ") else ""))
    return collections.Counter((op, tuple(commuted(op, [shape(x) for x in args[1:]])))
                               for _, op, args in ins
                               if ARITH.match(op) and not JUMP.match(op) and op != "EXIT")


def sass_diff(old_path, new_path):
    old, new = sass_functions(old_path), sass_functions(new_path)
    counts = collections.Counter()
    for fn in list(old) + [f for f in new if f not in old]:
        if fn not in new or fn not in old:
            verdict = "only in OLD" if fn in old else "only in NEW"
        elif canonical(old[fn]) == canonical(new[fn]):
            verdict = "same"
        else:
            arith = lambda op: bool(ARITH.match(op))
            a, b = canonical(old[fn], arith), canonical(new[fn], arith)
            if a == b or dataflow(old[fn], arith) == dataflow(new[fn], arith):
                verdict = "same arith"
            else:
                k = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                show = lambda s, k: s[k] if k < len(s) else "(end)"
                shapes = "equal" if op_shapes(old[fn]) == op_shapes(new[fn]) else "unequal"
                verdict = (f"DIFFERS at arithmetic instruction {k} of {len(a)} / {len(b)} "
                           f"(op shapes {shapes}): {show(a, k)}  |  {show(b, k)}")
        counts[verdict.split(" at ")[0]] += 1
        print(f"{verdict}  {fn}")
    print("# " + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
    return 1 if counts["DIFFERS"] or counts["only in OLD"] or counts["only in NEW"] else 0


def main(argv):
    if len(argv) < 2:
        die("usage: fp-forms.py ptx-lines PTX SRC LINE... | ptx-open PTX | sass SASS | sass-diff OLD NEW (--help)")
    if argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    cmd = argv[1]
    if cmd == "ptx-lines":
        if len(argv) < 5:
            die("usage: fp-forms.py ptx-lines PTX SRC LINE...")
        try:
            lines = [int(x) for x in argv[4:]]
        except ValueError:
            die("ptx-lines: each LINE is a line number")
        ptx_lines(argv[2], argv[3], lines)
    elif cmd == "ptx-open":
        if len(argv) != 3:
            die("usage: fp-forms.py ptx-open PTX")
        ptx_open(argv[2])
    elif cmd == "sass":
        if len(argv) != 3:
            die("usage: fp-forms.py sass SASS")
        sass(argv[2])
    elif cmd == "sass-diff":
        if len(argv) != 4:
            die("usage: fp-forms.py sass-diff OLD NEW")
        return sass_diff(argv[2], argv[3])
    else:
        die(f"unknown command {cmd} (ptx-lines, ptx-open, sass, sass-diff)")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    sys.exit(main(sys.argv))
