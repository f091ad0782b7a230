#!/usr/bin/env python3
"""Our weights in the official Mamba-3 module, and the official module's weights in ours.

Not used by any build or test: it needs PyTorch, Triton and CUDA (the GPU machine), and the
official sources (state-spaces/mamba, a source tree given with --mamba-src, or an installed
mamba_ssm). The safetensors reader and writer are plain Python (json + struct), so neither the
safetensors nor the h5py package is needed. docs/INTEROP.md gives the names, layouts and the
commands.

The model (docs/INTEROP.md §3; MODEL.md §3, TRAINING.md §1), tokens tok [B, T] in, logits out:

    h      = embedding.weight[tok] + embedding.bias                 [B, T, dm]   f32
    h      = h + Mamba3_l(RMSNorm(h; layers.l.norm.weight))         l = 0 … L−1  (official mixer)
    logits = RMSNorm(h; norm_f.weight) · lm_headᵀ                   [B, T, V]
    RMSNorm(u; w) = u / sqrt(mean(u²) + 1e-5) · w                   over the last axis, in f32

The official MixerModel computes the same pre-norm residual stack (its Block adds the residual
before the norm); the embedding bias is ours (nn.Embedding has none), so the ends are written
here in a few lines of torch instead.

Commands:
  check   --model M.safetensors --logits L.safetensors
          (a) M (from `m3h export`) loaded into official Mamba3 modules plus the ends above,
          run on L's tokens (from `m3h logits`); the logits compared with L's (our double
          reference) for the official module with f32 weights and under bf16 autocast, each
          against L's f32 and bf16 budgets (rel_l2 and max_abs, HARNESS.md §4). Exit 0 when
          the bf16-autocast run is within the bf16 budget, 1 otherwise.
  random  --config C.safetensors|--d-model … --out M.safetensors [--tokens FILE --logits-out O]
          (b) an official Mamba3 stack with the module's own random initialisation, written in
          our naming with the model config in __metadata__, for `m3h import` and `m3h compare
          --checkpoint`; with --tokens also the stack's logits on those rows (O holds them as
          'logits_f32' and 'logits_bf16', for `compare`).
  compare --logits L.safetensors --subject O.safetensors
          O's logits (from `random --logits-out`) against L's (from `m3h logits` on the
          imported checkpoint), with L's budgets. Pure Python: runs anywhere.
"""

import argparse
import array
import json
import math
import os
import struct
import sys
import types

# ---- safetensors, plain Python -------------------------------------------------------------

ELEMENT = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)}, metadata. Checks what it needs and says why not."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        sys.exit(f"{path}: truncated: {len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        sys.exit(f"{path}: the header length {n} runs past the end of the file")
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, e in header.items():
        dt, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        count = 1
        for d in shape:
            count *= d
        if dt not in ELEMENT or end - b != count * ELEMENT[dt] or base + end > len(data):
            sys.exit(f"{path}: tensor {name!r}: bad dtype or byte range")
        tensors[name] = (dt, list(shape), data[base + b : base + end])
    return tensors, meta


def floats(t):
    """A tensor's elements as a Python array('f') (F32, BF16 or F16, widened exactly)."""
    dt, _, raw = t
    if dt == "F32":
        a = array.array("f")
        a.frombytes(raw)
    elif dt == "BF16":
        h = array.array("H")
        h.frombytes(raw)
        a = array.array("f", struct.unpack(f"<{len(h)}f", struct.pack(f"<{len(h)}I", *[x << 16 for x in h])))
    elif dt == "F16":
        a = array.array("f", struct.unpack(f"<{len(raw) // 2}e", raw))
    else:
        sys.exit(f"tensor of dtype {dt} is not floating-point")
    if sys.byteorder != "little" and dt == "F32":
        a.byteswap()
    return a


def write_safetensors(path, tensors, meta):
    """tensors: [(name, shape, array('f') or array('i'))] in order, written back to back;
    the header padded to 8 bytes; temporary file + rename, so never a half file."""
    header = {"__metadata__": meta}
    offset, blobs = 0, []
    for name, shape, values in tensors:
        raw = values.tobytes()
        dt = "I32" if values.typecode == "i" else "F32"
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- the model config (MODEL.md §1) from __metadata__ -------------------------------------

CONFIG_FIELDS = ["d_model", "d_state", "expand", "headdim", "ngroups", "n_layers", "rope_fraction",
                 "a_floor", "is_outproj_norm", "input_dim", "input_proj_identity", "chunk_size",
                 "vocab_size"]


def config_of(meta, path):
    if "m3h.settings" not in meta:
        sys.exit(f"{path}: __metadata__ has no m3h.settings (not a file of m3h export)")
    s = {k: meta["m3h.setting." + k] for k in meta["m3h.settings"].split(",")}
    c = {}
    for k in CONFIG_FIELDS:
        v = s[k]
        c[k] = float(v) if k in ("rope_fraction", "a_floor") else int(v)
    if c["vocab_size"] <= 0:
        sys.exit(f"{path}: not a token model (vocab_size 0): the official stack is a language model")
    return c


def config_metadata(c):
    """__metadata__ of a config: what `m3h import` needs (docs/INTEROP.md §2)."""
    def text(k):
        v = c[k]
        return repr(float(v)) if k in ("rope_fraction", "a_floor") else str(int(v))
    meta = {"format": "pt", "m3h.interop": "1", "m3h.settings": ",".join(CONFIG_FIELDS)}
    for k in CONFIG_FIELDS:
        meta["m3h.setting." + k] = text(k)
    return meta


# ---- the official module and our ends (torch) ----------------------------------------------

def import_mamba3(src):
    """The official Mamba3 class. From a source tree, the package's __init__ (which loads the
    compiled selective-scan extension of Mamba-1) is skipped: only the Triton code is used."""
    if src:
        pkg_dir = os.path.join(os.path.abspath(src), "mamba_ssm")
        if not os.path.isfile(os.path.join(pkg_dir, "modules", "mamba3.py")):
            sys.exit(f"--mamba-src {src}: no mamba_ssm/modules/mamba3.py there")
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [pkg_dir]
        sys.modules["mamba_ssm"] = pkg
    from mamba_ssm.modules.mamba3 import Mamba3  # noqa: E402
    return Mamba3


def build_stack(Mamba3, c, device):
    import torch
    from torch import nn

    class Norm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n, device=device))

        def forward(self, u):
            u = u.float()
            return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight.float()

    class Embedding(nn.Module):
        def __init__(self, v, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(v, n, device=device) * 0.02)
            self.bias = nn.Parameter(torch.zeros(n, device=device))

        def forward(self, tok):
            return self.weight[tok].float() + self.bias.float()

    class Block(nn.Module):
        def __init__(self, l):
            super().__init__()
            self.norm = Norm(c["d_model"])
            self.mixer = Mamba3(d_model=c["d_model"], d_state=c["d_state"], expand=c["expand"],
                                headdim=c["headdim"], ngroups=c["ngroups"],
                                rope_fraction=c["rope_fraction"], A_floor=c["a_floor"],
                                is_outproj_norm=bool(c["is_outproj_norm"]),
                                chunk_size=c["chunk_size"], layer_idx=l, device=device,
                                dtype=torch.float32)

        def forward(self, h):
            return h + self.mixer(self.norm(h)).float()

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = Embedding(c["vocab_size"], c["d_model"])
            self.layers = nn.ModuleList([Block(l) for l in range(c["n_layers"])])
            self.norm_f = Norm(c["d_model"])

    class LM(nn.Module):
        # state_dict() names are the file's: backbone.layers.<l>.mixer.in_proj.weight, …
        def __init__(self):
            super().__init__()
            self.backbone = Backbone()
            self.lm_head = nn.Linear(c["d_model"], c["vocab_size"], bias=False, device=device)

        def forward(self, tok):
            h = self.backbone.embedding(tok)
            for blk in self.backbone.layers:
                h = blk(h)
            return self.lm_head(self.backbone.norm_f(h)).float()

    return LM()


def load_into(model, tensors, path):
    """Copies the file's tensors into the stack (exact f32). The mixer's norm.weight of a model
    without the gated norm has no official parameter: the plain gate never reads it, so it is
    dropped. Anything else that does not match is an error naming it."""
    import torch
    state = model.state_dict()
    for name, t in tensors.items():
        if name not in state:
            if name.endswith(".mixer.norm.weight"):
                continue
            sys.exit(f"{path}: tensor {name!r} has no place in the official stack")
        if list(state[name].shape) != t[1]:
            sys.exit(f"{path}: tensor {name!r} is {t[1]}, the official stack's {list(state[name].shape)}")
        state[name].copy_(torch.tensor(floats(t), dtype=torch.float32).reshape(t[1]))
    missing = [k for k in state if k not in tensors]
    if missing:
        sys.exit(f"{path}: no tensor for the official stack's {missing[0]!r}")


def stack_logits(model, tok, autocast_bf16):
    import torch
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_bf16):
        return model(tok).float()


# ---- metrics and the verdict (HARNESS.md §3–§4) -----------------------------------------------

def errors(subject, oracle):
    """rel_l2 = ‖s − o‖₂ / ‖o‖₂ and max_abs = max |s − o| (pure Python, in double)."""
    d2 = o2 = mx = 0.0
    for s, o in zip(subject, oracle):
        d = s - o
        d2 += d * d
        o2 += o * o
        mx = max(mx, abs(d)) if d == d else math.inf
    return (math.sqrt(d2 / o2) if o2 > 0 else math.sqrt(d2 / max(1, len(oracle)))), mx


def verdict(label, subject, ref_meta, oracle):
    rel, mx = errors(subject, oracle)
    print(f"{label}: rel_l2 {rel:.3e}, max_abs {mx:.3e}")
    ok = {}
    for p in ("f32", "bf16"):
        key = f"m3h.budget.{p}"
        if key + ".rel_l2" not in ref_meta:
            continue
        br, bm = float(ref_meta[key + ".rel_l2"]), float(ref_meta[key + ".max_abs"])
        pct = 100 * max(rel / br, mx / bm)
        ok[p] = rel <= br and mx <= bm
        print(f"    {p:4s} budget rel_l2 {br:.3e} max_abs {bm:.3e}: {pct:8.1f} % of budget -> "
              f"{'PASS' if ok[p] else 'FAIL'}")
    return ok


# ---- commands --------------------------------------------------------------------------------

def cmd_check(a):
    import torch
    Mamba3 = import_mamba3(a.mamba_src)
    tensors, meta = read_safetensors(a.model)
    c = config_of(meta, a.model)
    ref, ref_meta = read_safetensors(a.logits)
    B, T = ref["tokens"][1]
    tok_raw = array.array("i")
    tok_raw.frombytes(ref["tokens"][2])
    oracle = floats(ref["logits"])
    torch.manual_seed(0)
    model = build_stack(Mamba3, c, "cuda")
    load_into(model, tensors, a.model)
    tok = torch.tensor(list(tok_raw), dtype=torch.long, device="cuda").reshape(B, T)
    print(f"model {a.model}: " + " ".join(f"{k}={c[k]}" for k in CONFIG_FIELDS))
    print(f"tokens {B}x{T}, logits [B, T, V={c['vocab_size']}] against {a.logits} "
          f"({ref_meta.get('m3h.logits.oracle', '?')}, scan {ref_meta.get('m3h.logits.scan', '?')})")
    result = {}
    for label, bf16 in (("official, f32 weights", False), ("official, bf16 autocast", True)):
        out = stack_logits(model, tok, bf16).reshape(-1).cpu().tolist()
        result[label] = verdict(label, out, ref_meta, oracle)
    return 0 if result["official, bf16 autocast"].get("bf16", False) else 1


def cmd_random(a):
    import torch
    Mamba3 = import_mamba3(a.mamba_src)
    if a.config:
        _, meta = read_safetensors(a.config)
        c = config_of(meta, a.config)
    else:
        c = {"d_model": a.d_model, "d_state": a.d_state, "expand": a.expand, "headdim": a.headdim,
             "ngroups": a.ngroups, "n_layers": a.layers, "rope_fraction": a.rope_fraction,
             "a_floor": 1e-4, "is_outproj_norm": int(a.outproj_norm), "input_dim": a.vocab,
             "input_proj_identity": 0, "chunk_size": a.chunk_size, "vocab_size": a.vocab}
    torch.manual_seed(a.seed)
    model = build_stack(Mamba3, c, "cuda")
    out = []
    for name, v in model.state_dict().items():
        out.append((name, list(v.shape), array.array("f", v.detach().float().reshape(-1).cpu().tolist())))
    write_safetensors(a.out, out, config_metadata(c))
    print(f"wrote {a.out}: {len(out)} tensors of an official Mamba3 stack (seed {a.seed}): "
          + " ".join(f"{k}={c[k]}" for k in CONFIG_FIELDS))
    if a.tokens:
        rows = []
        with open(a.tokens) as f:
            for line in f:
                line = line.split("#")[0].replace(",", " ").split()
                if line:
                    rows.append([int(x) for x in line])
        tok = torch.tensor(rows, dtype=torch.long, device="cuda")
        B, T = tok.shape
        res = [("tokens", [B, T], array.array("i", [x for r in rows for x in r]))]
        for label, bf16 in (("logits_f32", False), ("logits_bf16", True)):
            lg = stack_logits(model, tok, bf16)
            res.append((label, list(lg.shape), array.array("f", lg.reshape(-1).cpu().tolist())))
        write_safetensors(a.logits_out, res, {"format": "pt"})
        print(f"wrote {a.logits_out}: the official stack's logits on {B}x{T} tokens")
    return 0


def cmd_compare(a):
    ref, ref_meta = read_safetensors(a.logits)
    sub, _ = read_safetensors(a.subject)
    oracle = floats(ref["logits"])
    if ref["tokens"][2] != sub["tokens"][2]:
        sys.exit(f"{a.subject}: other tokens than {a.logits}'s")
    labels = [k for k in ("logits_f32", "logits_bf16") if k in sub]
    if not labels:
        sys.exit(f"{a.subject}: no logits_f32 or logits_bf16 (a file of `random --logits-out`)")
    ok = True
    for label in labels:
        v = verdict(f"official {label[7:]}", floats(sub[label]), ref_meta, oracle)
        ok = ok and v.get("bf16", False)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="(a) an exported model in the official module: logits vs ours")
    c.add_argument("--model", required=True)
    c.add_argument("--logits", required=True, help="the file of `m3h logits` (tokens, logits, budgets)")
    c.add_argument("--mamba-src", help="a state-spaces/mamba source tree (default: installed mamba_ssm)")
    r = sub.add_parser("random", help="(b) a randomly initialised official stack in our naming")
    r.add_argument("--out", required=True)
    r.add_argument("--config", help="take the model config from this safetensors file's metadata")
    r.add_argument("--d-model", type=int, default=128)
    r.add_argument("--d-state", type=int, default=32)
    r.add_argument("--expand", type=int, default=2)
    r.add_argument("--headdim", type=int, default=32)
    r.add_argument("--ngroups", type=int, default=1)
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--rope-fraction", type=float, default=0.5)
    r.add_argument("--outproj-norm", action="store_true")
    r.add_argument("--chunk-size", type=int, default=64)
    r.add_argument("--vocab", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--tokens", help="token rows (one sequence per line) to run the stack on")
    r.add_argument("--logits-out", help="where the stack's logits on --tokens go")
    r.add_argument("--mamba-src")
    m = sub.add_parser("compare", help="official logits (random --logits-out) vs m3h logits")
    m.add_argument("--logits", required=True)
    m.add_argument("--subject", required=True)
    a = ap.parse_args()
    if a.cmd == "random" and bool(a.tokens) != bool(a.logits_out):
        ap.error("random: --tokens and --logits-out go together")
    return {"check": cmd_check, "random": cmd_random, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
