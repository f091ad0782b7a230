# Functions for reading `ncu --csv` output (one row per kernel launch and metric), shared by
# scripts/ncu-compare.sh and scripts/ncu-roofline.sh, which put this file's text in front of
# their own awk program. POSIX awk (mawk) only.
#   split_csv(line, f)   the fields of a CSV line into f[1..n], returns n (quoted fields may
#                        hold commas; "" inside quotes is one quote)
#   kernel_key(name)     a kernel's row name: no parameter list, no namespaces, the 16-bit
#                        storage types (__nv_bfloat16, __half) written T, so that a kernel's
#                        bf16 and f16 instantiations share a row; cuBLAS's kernels (nvjet,
#                        cutlass, xmma, gemm, cublasLt) are one row, "GEMMs (cuBLAS)"
#   unit_scale(u, kind)  the factor that brings a value in unit u to kind's base unit, or -1
#                        for a unit it does not know: "time" → µs (ns, us, ms, s and ncu's
#                        nsecond, usecond, msecond, second); "count" → 1 (byte or inst with an
#                        optional decimal prefix K, M, G, T, or no unit); "rate" → Hz (cycle/
#                        second, cycle/msecond, cycle/usecond, cycle/nsecond, Hz, KHz, MHz, GHz)
#   csv_header(f, n)     on the header row: sets kc, mc, uc, vc, ic to the columns Kernel Name,
#                        Metric Name, Metric Unit, Metric Value and ID (0 if absent)
#   csv_value(v)         a Metric Value as a number (its thousands separators removed)

function split_csv(line, f,    n, i, c, q, cur) {
  n = 0; cur = ""; q = 0
  for (i = 1; i <= length(line); i++) {
    c = substr(line, i, 1)
    if (q) {
      if (c == "\"") {
        if (substr(line, i + 1, 1) == "\"") { cur = cur "\""; i++ } else q = 0
      } else cur = cur c
    } else if (c == "\"") q = 1
    else if (c == ",") { f[++n] = cur; cur = "" }
    else cur = cur c
  }
  f[++n] = cur
  return n
}

function kernel_key(k) {
  sub(/\(.*$/, "", k)                     # the parameter list
  sub(/^void /, "", k)
  gsub(/<unnamed>::|\(anonymous namespace\)::/, "", k)
  sub(/^m3::(gpu::)?/, "", k)
  gsub(/__nv_bfloat16|__half/, "T", k)
  if (k ~ /^(nvjet|cutlass|sm[0-9]+_xmma|.*gemm|.*cublasLt)/) k = "GEMMs (cuBLAS)"
  return k
}

function prefix_scale(p) {
  if (p == "") return 1
  if (p == "K") return 1e3
  if (p == "M") return 1e6
  if (p == "G") return 1e9
  if (p == "T") return 1e12
  return -1
}

function unit_scale(u, kind,    p) {
  if (kind == "time") {
    if (u == "ns" || u == "nsecond") return 0.001
    if (u == "us" || u == "usecond") return 1
    if (u == "ms" || u == "msecond") return 1000
    if (u == "s" || u == "second") return 1e6
    return -1
  }
  if (kind == "count") {
    if (u == "") return 1
    p = u
    if (sub(/byte$/, "", p) || sub(/inst$/, "", p)) return prefix_scale(p)
    return -1
  }
  if (kind == "rate") {
    if (u == "cycle/second") return 1
    if (u == "cycle/msecond") return 1e3
    if (u == "cycle/usecond") return 1e6
    if (u == "cycle/nsecond") return 1e9
    p = u
    if (sub(/[Hh]z$/, "", p)) return prefix_scale(p)
    return -1
  }
  return -1
}

function csv_header(f, n,    i) {
  kc = mc = uc = vc = ic = 0
  for (i = 1; i <= n; i++) {
    if (f[i] == "Kernel Name") kc = i
    if (f[i] == "Metric Name") mc = i
    if (f[i] == "Metric Unit") uc = i
    if (f[i] == "Metric Value") vc = i
    if (f[i] == "ID") ic = i
  }
}

function csv_value(v) {
  gsub(/,/, "", v)
  return v + 0
}
