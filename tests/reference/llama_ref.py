#!/usr/bin/python3
"""llama_ref.py: an independent NumPy reference for Hugging Face transformers'
LlamaForCausalLM forward pass and greedy generation.

It exists to check the C engine against, so it favours being obviously right
over being fast: float64 by default, no KV cache (every generation step
recomputes the whole sequence), one function per piece of the model.

    python3 tests/reference/llama_ref.py MODEL_DIR --prompt-ids 1,2,3 \
        --max-tokens N [--logits-out FILE] [--f32] [--stop-at-eos] [--kv-dtype bf16|int8]
        [--matmul-dtype bf16] [--weights-dtype int8]

As a module: load_model(dir) -> dict, forward(model, ids) -> logits [T, V],
generate(model, ids, n) -> list of generated ids.
"""
import json
import math
import os
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the machine
    # A pyenv python3 may shadow Debian's, which is the one with python3-numpy:
    # when run as a script, retry under /usr/bin/python3 instead of failing.
    if __name__ == "__main__" and os.path.exists("/usr/bin/python3") and \
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

# --------------------------------------------------------------------------
# safetensors: u64 little-endian header length, JSON header, then the data
# area; each tensor's data_offsets are [begin, end) relative to the data area.
# --------------------------------------------------------------------------
_ST_DTYPES = {"F64": (np.float64, 8), "F32": (np.float32, 4),
              "F16": (np.float16, 2), "BF16": (np.uint16, 2), "I8": (np.int8, 1),
              "F8_E4M3": (np.uint8, 1)}


def e4m3_values():
    """The 256 values of FP8 E4M3 ("FN": no infinities, S.1111.111 NaN),
    indexed by their bit pattern."""
    v = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            v[b] = np.nan
        elif e == 0:
            v[b] = sign * m * 2.0 ** -9
        else:
            v[b] = sign * (1 + m / 8.0) * 2.0 ** (e - 7)
    return v


def read_safetensors(path):
    """Returns {name: float32/float64 ndarray} for every tensor in one file."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: shorter than the 8-byte header length")
        (hlen,) = np.frombuffer(raw_len, dtype="<u8")
        header = json.loads(f.read(int(hlen)).decode("utf-8"))
    data_start = 8 + int(hlen)
    # memmap so a big shard is not read whole just to take a few tensors.
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{path}: {name}: unsupported dtype {dt}")
        np_dt, size = _ST_DTYPES[dt]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if end - begin != size * int(np.prod(shape, dtype=np.int64)) or \
                data_start + end > blob.size or begin > end:
            raise ValueError(f"{path}: {name}: data_offsets {begin},{end} "
                             f"do not match shape {shape} of {dt}")
        buf = blob[data_start + begin:data_start + end]
        arr = buf.view(np.dtype(np_dt).newbyteorder("<")).reshape(shape)
        out[name] = decode_dtype(arr, dt)
        if dt == "I8":
            out.setdefault("__i8__", set()).add(name)   # for apply_scales
    return out


def decode_dtype(arr, dt):
    """Stored values -> float ndarray.  BF16 is the top half of a float32, so
    widening is exact: put the 16 bits in the high half and reinterpret."""
    if dt == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dt == "F16":
        return arr.astype(np.float32)  # every float16 is exact in float32
    if dt == "I8":
        return arr.astype(np.float32)  # an int8 checkpoint's integers (scaled later)
    if dt == "F8_E4M3":
        return e4m3_values()[arr]      # exact in float32 (scaled later)
    return np.array(arr)  # F32/F64: copy out of the memmap


def apply_scales(tensors):
    """A quantized checkpoint's matrices (I8 or F8_E4M3 "X.weight" with
    "X.weight_scale", one scale a row or one for the matrix) multiplied out,
    each row by its scale in float32, as the engine widens them: {name:
    array} without the scales."""
    out, held = {}, set()
    int8_names = tensors.get("__i8__", set())   # the I8 tensors read_safetensors found
    for name, arr in tensors.items():
        if name.startswith("__") or (name.endswith("_scale") and name[:-len("_scale")] in tensors):
            continue
        scale = tensors.get(name + "_scale")
        if scale is not None:
            s = np.asarray(scale, dtype=np.float32)
            s = s.reshape(-1, 1) if s.size > 1 else s.reshape(1, 1)   # a row's, or the matrix's
            q = np.asarray(arr, dtype=np.float32)
            if name in int8_names:
                q = np.maximum(q, np.float32(-127))   # the engine holds -128 as -127
                held.add(name)
            arr = (q * s).astype(np.float32)
        out[name] = arr
    out["__int8_held__"] = held   # int8 weights keep these as the file has them
    return out


def read_checkpoint(model_dir):
    """All tensors of a model directory: one file, or a sharded index."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        tensors, i8 = {}, set()
        for fname in sorted(set(weight_map.values())):
            part = read_safetensors(os.path.join(model_dir, fname))
            i8 |= part.pop("__i8__", set())
            tensors.update(part)
        tensors["__i8__"] = i8
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise ValueError(f"{index}: tensors listed but not found: {missing[:3]}")
        return apply_scales(tensors)
    return apply_scales(read_safetensors(os.path.join(model_dir, "model.safetensors")))


# --------------------------------------------------------------------------
# config.json, with LlamaConfig's defaults
# --------------------------------------------------------------------------
def parse_config(raw):
    """Normalises a config.json dict; refuses what this reference cannot do
    rather than silently computing something else."""
    def get(key, default):
        v = raw.get(key)
        return default if v is None else v

    cfg = {k: int(raw[k]) for k in ("hidden_size", "intermediate_size",
                                    "num_hidden_layers", "num_attention_heads",
                                    "vocab_size")}
    cfg["num_key_value_heads"] = int(get("num_key_value_heads", cfg["num_attention_heads"]))
    cfg["rms_norm_eps"] = float(get("rms_norm_eps", 1e-6))
    cfg["rope_theta"] = float(get("rope_theta", 10000.0))
    cfg["head_dim"] = int(get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))
    cfg["tie_word_embeddings"] = bool(get("tie_word_embeddings", False))
    cfg["attention_bias"] = bool(get("attention_bias", False))
    cfg["mlp_bias"] = bool(get("mlp_bias", False))
    eos = raw.get("eos_token_id")
    cfg["eos_token_ids"] = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r} unsupported (only silu)")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    rs = raw.get("rope_scaling")
    cfg["rope_scaling"] = None
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            cfg["rope_scaling"] = {
                "factor": float(rs["factor"]),
                "low_freq_factor": float(rs["low_freq_factor"]),
                "high_freq_factor": float(rs["high_freq_factor"]),
                "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}
        elif kind != "default":
            raise ValueError(f"rope_scaling type {kind!r} unsupported (only llama3)")
    return cfg


# --------------------------------------------------------------------------
# Building the model dict
# --------------------------------------------------------------------------
def load_model(model_dir, dtype=np.float64):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = parse_config(json.load(f))
    return build_model(cfg, read_checkpoint(model_dir), dtype)


def build_model(cfg, tensors, dtype=np.float64):
    """cfg (from parse_config) + {name: array} -> model dict.  Separate from
    load_model so tests can build variants in memory."""
    held = tensors.get("__int8_held__", set())   # an int8 checkpoint's matrices (apply_scales)

    def w(name):
        if name not in tensors:
            raise KeyError(f"tensor {name} missing from the checkpoint")
        return np.asarray(tensors[name], dtype=dtype)

    D, H, KV, hd = (cfg["hidden_size"], cfg["num_attention_heads"],
                    cfg["num_key_value_heads"], cfg["head_dim"])
    shapes = {"q_proj": (H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
              "o_proj": (D, H * hd), "gate_proj": (cfg["intermediate_size"], D),
              "up_proj": (cfg["intermediate_size"], D),
              "down_proj": (D, cfg["intermediate_size"])}
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {"input_layernorm": w(p + "input_layernorm.weight"),
                 "post_attention_layernorm": w(p + "post_attention_layernorm.weight")}
        for proj, shape in shapes.items():
            part = "self_attn." if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp."
            layer[proj] = w(p + part + proj + ".weight")
            layer[proj + ".held"] = p + part + proj + ".weight" in held
            if layer[proj].shape != shape:
                raise ValueError(f"{p}{part}{proj}.weight has shape "
                                 f"{layer[proj].shape}, config implies {shape}")
            # Biases exist only when the config says so, as in HF.
            has_bias = cfg["attention_bias"] if part == "self_attn." else cfg["mlp_bias"]
            layer[proj + ".bias"] = w(p + part + proj + ".bias") if has_bias else None
        layers.append(layer)
    embed = w("model.embed_tokens.weight")
    embed_held = "model.embed_tokens.weight" in held
    # Tied: HF points lm_head at the embedding, whatever lm_head.weight the
    # file may also hold.
    lm_head = embed if cfg["tie_word_embeddings"] else w("lm_head.weight")
    lm_held = embed_held if cfg["tie_word_embeddings"] else "lm_head.weight" in held
    return {"config": cfg, "dtype": dtype, "embed_tokens": embed, "layers": layers,
            "embed_held": embed_held, "lm_held": lm_held,
            "norm": w("model.norm.weight"), "lm_head": lm_head,
            "inv_freq": rope_inv_freq(cfg).astype(dtype)}


# --------------------------------------------------------------------------
# The pieces of the model
# --------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    # Llama's RMSNorm has no mean subtraction and no bias.
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_inv_freq(cfg):
    """inv_freq[i] = 1 / theta^(2i/hd), optionally rescaled as Llama 3.1."""
    hd = cfg["head_dim"]
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    rs = cfg["rope_scaling"]
    if rs is None:
        return inv_freq
    return llama3_scale_inv_freq(inv_freq, rs["factor"], rs["low_freq_factor"],
                                 rs["high_freq_factor"],
                                 rs["original_max_position_embeddings"])


def llama3_scale_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, orig_max):
    """Llama 3.1's context extension: slow rotations (long wavelengths) are
    slowed down by `factor`, fast ones kept, and the band between blended."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = orig_max / low_freq_factor
    high_freq_wavelen = orig_max / high_freq_factor
    out = inv_freq.copy()
    for i, (f, wl) in enumerate(zip(inv_freq, wavelen)):
        if wl > low_freq_wavelen:
            out[i] = f / factor
        elif wl >= high_freq_wavelen:  # medium band, both edges inclusive as in HF
            smooth = (orig_max / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def rope_cos_sin(inv_freq, positions):
    """cos/sin tables [T, hd]: HF duplicates the frequencies (concat, not
    interleave), pairing dimension i with i + hd/2."""
    freqs = np.outer(np.asarray(positions, dtype=inv_freq.dtype), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """x [T, heads, hd]; cos/sin [T, hd] broadcast over heads."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def linear(x, weight, bias=None, x_round=None):
    # nn.Linear stores weight as [out, in].  x_round, when given, is applied
    # to the input first, as an engine that multiplies in a narrower type
    # rounds it (matmul_dtype: bf16).
    if x_round is not None:
        x = x_round(x)
    y = x @ weight.T
    return y if bias is None else y + bias


def round_bf16(a):
    """a rounded to bfloat16 (to nearest, ties to even) and widened back: what
    a KV cache of bf16 holds (kv_dtype: bf16)."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(a.dtype)


def quantize_int8(a):
    """Each row of a (its last axis) as integers q = round-half-even(x / s)
    in [-127, 127] with s = max |x| / 127, all in float32: (q, s)."""
    x = np.asarray(a, dtype=np.float32)
    s = np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(x / np.where(s > 0, s, np.float32(1))), np.float32(0))
    return np.clip(q, -127, 127).astype(np.float32), s


def round_int8(a):
    """a [..., head_dim] as a KV cache of int8 holds it (kv_dtype: int8): each
    row of head_dim elements (one position of one KV head) quantized by
    quantize_int8 and read back as q * s.  The same rule holds each row of a
    weight matrix with weights_dtype int8."""
    q, s = quantize_int8(a)
    return (q.astype(np.float64) * s.astype(np.float64)).astype(a.dtype)


def round_int8_blocks(a, block=32):
    """Each row of a (its last axis) as an engine with weights_dtype int8
    quantizes a product's input: in blocks of `block` columns (the last one
    shorter), each by quantize_int8 (scale max |block| / 127, to nearest
    even), read back as q * s."""
    x = np.asarray(a, dtype=np.float32)
    n = x.shape[-1]
    out = np.empty(x.shape, dtype=np.float64)
    for k0 in range(0, n, block):
        q, s = quantize_int8(x[..., k0:k0 + block])
        out[..., k0:k0 + block] = q.astype(np.float64) * s.astype(np.float64)
    return out.astype(a.dtype)


def attention(layer, cfg, x, cos, sin, kv_round=None, x_round=None):
    """Causal grouped-query self-attention over x [T, D] -> [T, D].  kv_round,
    when given, is applied to the keys (after RoPE) and values, as a KV cache
    of a narrower type stores them; x_round to the inputs of the products."""
    T = x.shape[0]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = linear(x, layer["q_proj"], layer["q_proj.bias"], x_round).reshape(T, H, hd)
    k = linear(x, layer["k_proj"], layer["k_proj.bias"], x_round).reshape(T, KV, hd)
    v = linear(x, layer["v_proj"], layer["v_proj.bias"], x_round).reshape(T, KV, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv_round is not None:
        k, v = kv_round(k), kv_round(v)
    # GQA: query head h reads KV head h // (H / KV) (HF's repeat_kv repeats
    # each KV head consecutively).
    kv_of_head = np.arange(H) // (H // KV)
    k, v = k[:, kv_of_head, :], v[:, kv_of_head, :]
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)        # [H, T, T]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)               # s > t
    scores = np.where(future[None], -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)             # stable softmax
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(T, H * hd)
    return linear(out, layer["o_proj"], layer["o_proj.bias"], x_round)


def silu(x):
    return x / (1 + np.exp(-x))


def mlp(layer, x, x_round=None):
    gate = linear(x, layer["gate_proj"], layer["gate_proj.bias"], x_round)
    up = linear(x, layer["up_proj"], layer["up_proj.bias"], x_round)
    return linear(silu(gate) * up, layer["down_proj"], layer["down_proj.bias"], x_round)


def round_matmuls(model, rnd, inputs=True):
    """Makes model multiply as an engine with matmul_dtype bf16 does: every
    weight matrix (the embedding and the LM head too) rounded by rnd, and
    each product's input rounded by it as the product runs.  Norm weights
    and the residual stream stay as they are.  inputs may name another
    rounding for the products' inputs: an engine with weights_dtype int8
    is round_matmuls(model, round_int8, round_int8_blocks) (each row of a
    matrix by its own scale, max |row| / 127; each input row in blocks of
    32, each by its own)."""
    # int8 weights take an int8 checkpoint's matrices as the file has them
    keep = rnd is round_int8
    for layer in model["layers"]:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            if not (keep and layer.get(proj + ".held")):
                layer[proj] = rnd(layer[proj])
    tied = model["lm_head"] is model["embed_tokens"]
    if not (keep and model.get("embed_held")):
        model["embed_tokens"] = rnd(model["embed_tokens"])
    if tied:
        model["lm_head"] = model["embed_tokens"]
    elif not (keep and model.get("lm_held")):
        model["lm_head"] = rnd(model["lm_head"])
    if inputs is True:
        model["x_round"] = rnd
    elif inputs:
        model["x_round"] = inputs
    return model


def forward(model, ids):
    """Token ids (positions 0..T-1) -> logits [T, vocab]."""
    cfg = model["config"]
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("forward needs a non-empty 1-D list of token ids")
    if ids.min() < 0 or ids.max() >= cfg["vocab_size"]:
        raise ValueError(f"token id out of range [0, {cfg['vocab_size']})")
    eps = cfg["rms_norm_eps"]
    cos, sin = rope_cos_sin(model["inv_freq"], np.arange(len(ids)))
    x = model["embed_tokens"][ids]
    xr = model.get("x_round")
    with np.errstate(over="ignore"):  # exp overflow in silu gives the right limit
        for layer in model["layers"]:
            x = x + attention(layer, cfg, rms_norm(x, layer["input_layernorm"], eps), cos, sin,
                              model.get("kv_round"), xr)
            x = x + mlp(layer, rms_norm(x, layer["post_attention_layernorm"], eps), xr)
    return linear(rms_norm(x, model["norm"], eps), model["lm_head"], None, xr)


def generate(model, ids, n, eos_ids=(), step_logits=None):
    """Greedy decoding of up to n tokens after ids.  Each step recomputes the
    full forward (no cache to get wrong).  Stops after emitting a token in
    eos_ids (which is kept, as HF's generate does).  If step_logits is a list,
    each step's last-position logits are appended to it."""
    seq, out = [int(i) for i in ids], []
    for _ in range(n):
        logits = forward(model, seq)[-1]
        if step_logits is not None:
            step_logits.append(logits)
        tok = int(np.argmax(logits))  # first maximum on ties, like torch.argmax
        out.append(tok)
        seq.append(tok)
        if tok in eos_ids:
            break
    return out


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--logits-out", help="FILE: first step's logits, one per line; "
                    "FILE.all: every step's logits, one line per step")
    ap.add_argument("--f32", action="store_true", help="compute in float32 (default float64)")
    ap.add_argument("--kv-dtype", choices=("f32", "bf16", "int8"), default="f32",
                    help="bf16, int8: keys and values rounded as a KV cache of that type "
                    "holds them")
    ap.add_argument("--matmul-dtype", choices=("f32", "bf16"), default="f32",
                    help="bf16: weights and each product's input rounded as an engine "
                    "with matmul_dtype bf16 multiplies")
    ap.add_argument("--weights-dtype", choices=("auto", "int8"), default="auto",
                    help="int8: every weight matrix rounded as an engine with weights_dtype "
                    "int8 holds it (per row, scale max |row| / 127) and each product's input "
                    "as it quantizes them (per row in blocks of 32)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="stop after generating config.json's eos_token_id")
    args = ap.parse_args(argv)
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip() != ""]
    except ValueError:
        ap.error(f"--prompt-ids {args.prompt_ids!r}: not comma-separated integers")
    if not prompt or args.max_tokens < 0:
        ap.error("need at least one prompt id and --max-tokens >= 0")

    model = load_model(args.model_dir, np.float32 if args.f32 else np.float64)
    if args.kv_dtype != "f32":
        model["kv_round"] = round_bf16 if args.kv_dtype == "bf16" else round_int8
    if args.matmul_dtype == "bf16":
        round_matmuls(model, round_bf16)
    if args.weights_dtype == "int8":
        round_matmuls(model, round_int8, round_int8_blocks)
    eos = model["config"]["eos_token_ids"] if args.stop_at_eos else ()
    steps = []
    out = generate(model, prompt, args.max_tokens, eos, steps)
    print(",".join(str(t) for t in out))
    if args.logits_out:
        first = steps[0] if steps else forward(model, prompt)[-1]
        with open(args.logits_out, "w") as f:
            f.writelines("%.9g\n" % v for v in first)
        with open(args.logits_out + ".all", "w") as f:
            f.writelines(" ".join("%.9g" % v for v in s) + "\n" for s in steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
