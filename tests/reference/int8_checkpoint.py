#!/usr/bin/python3
"""int8_checkpoint.py: writes an int8 checkpoint of a model, the layout
Tessera's CPU engine loads as it is: every linear weight of the layers
("model.layers.N.*_proj.weight") as I8 [out, in] beside "<name>_scale", F32
[out, 1] (one scale a row), quantized by llama_ref.quantize_int8, the rule
an engine with weights_dtype int8 applies at load; the embedding, the LM
head and the norms are copied as they are.  --fp8 writes the FP8 layout
instead: F8_E4M3 weights, scale max |row| / 448 ([out, 1]), or with
--per-tensor one for the matrix (shape []), values rounded to the nearest
E4M3, ties to even.

    python3 tests/reference/int8_checkpoint.py SRC_DIR DST_DIR
        [--break missing|shape|nan|zero|vector] [--scale-dtype F32|BF16] [--flat]
        [--fp8 [--per-tensor]] [--first Q]

--break damages the scales of model.layers.0.self_attn.k_proj.weight (drops
them, gives them shape [out + 1, 1], a NaN or a zero), or with "vector"
stores model.layers.0.input_layernorm.weight as I8: what a loader must
refuse, naming the tensor.  --flat stores the scales as [out] instead of
[out, 1].  --first Q stores the int8 Q (-128 too) as that k_proj's first
integer.  config.json (and any tokenizer files) are copied."""
import argparse
import json
import os
import shutil
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the machine
    # as llama_ref.py: Debian's python3 has python3-numpy where a pyenv one may not
    if os.path.exists("/usr/bin/python3") and \
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402  (after the path)


def write_safetensors(path, tensors):
    """tensors: [(name, dtype name, ndarray)] in order, little-endian."""
    header, blobs, at = {}, [], 0
    for name, dt, arr in tensors:
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for b in blobs:
            f.write(b)


def to_e4m3(x):
    """float32 array -> E4M3 bit patterns (uint8): nearest, ties to even,
    saturated at 448."""
    vals = llama_ref.e4m3_values()[:0x7F]            # 0 .. 448, increasing with the pattern
    a = np.minimum(np.abs(np.asarray(x, dtype=np.float32)), np.float32(448))
    hi = np.clip(np.searchsorted(vals, a), 1, 0x7E)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a == 0, 0, pick)
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--break", dest="brk", choices=("missing", "shape", "nan", "zero", "vector"))
    ap.add_argument("--scale-dtype", choices=("F32", "BF16"), default="F32")
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--per-tensor", action="store_true")
    ap.add_argument("--first", type=int, choices=range(-128, 128), metavar="Q")
    a = ap.parse_args()
    if a.per_tensor and not a.fp8:
        ap.error("--per-tensor goes with --fp8 (int8 checkpoints have a scale a row)")
    if a.per_tensor and a.brk in ("shape", "nan", "zero"):
        ap.error(f"--break {a.brk} damages a scale of a row: not with --per-tensor")
    src = llama_ref.read_checkpoint(a.src)
    os.makedirs(a.dst, exist_ok=True)
    for f in os.listdir(a.src):
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(a.src, f), a.dst)
    victim = "model.layers.0.self_attn.k_proj.weight"
    out = []
    for name in sorted(n for n in src if not n.startswith("__")):
        arr = np.asarray(src[name], dtype=np.float32)
        if name == "model.layers.0.input_layernorm.weight" and a.brk == "vector":
            out.append((name, "I8", np.ones(arr.shape, dtype=np.int8)))
            continue
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out.append((name, "F32", arr))
            continue
        if a.fp8:
            m = np.max(np.abs(arr)) if a.per_tensor else np.max(np.abs(arr), axis=-1, keepdims=True)
            s = (np.asarray(m, dtype=np.float32) / np.float32(448)).reshape(-1, 1)
            out.append((name, "F8_E4M3", to_e4m3(arr / s)))
        else:
            q, s = llama_ref.quantize_int8(arr)
            if name == victim and a.first is not None:
                q[0, 0] = a.first
            out.append((name, "I8", q.astype(np.int8)))
        s = s.astype(np.float32)
        if name == victim and a.brk == "missing":
            continue
        if name == victim and a.brk == "shape":
            s = np.concatenate([s, s[:1]])
        if name == victim and a.brk == "nan":
            s[3, 0] = np.nan
        if name == victim and a.brk == "zero":
            s[2, 0] = 0
        if a.flat:
            s = s.reshape(-1)
        if a.per_tensor:
            s = s.reshape(())
        if a.scale_dtype == "BF16":
            bits = s.view(np.uint32)
            if np.any((bits & 0xFFFF) != 0) and a.brk is None:
                sys.exit("int8_checkpoint.py: these scales are not exact in BF16; use F32")
            out.append((name + "_scale", "BF16", (bits >> 16).astype(np.uint16)))
        else:
            out.append((name + "_scale", "F32", s))
    write_safetensors(os.path.join(a.dst, "model.safetensors"), out)


if __name__ == "__main__":
    main()
