#!/usr/bin/python3
"""make_tiny.py: writes a small random Llama checkpoint (config.json +
model.safetensors, or shards + model.safetensors.index.json) to test the
reference and the C engine on.

    python3 tests/reference/make_tiny.py OUT_DIR [--dtype f32|bf16|f16] [--tied]
        [--kv-heads N] [--llama3-rope] [--seed S] [--shards N] [...sizes]
"""
import json
import os
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover - see llama_ref.py
    if __name__ == "__main__" and os.path.exists("/usr/bin/python3") and \
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise


def f32_to_bf16_bits(x, truncate=False):
    """float32 -> bf16 bit patterns (uint16).  Round-to-nearest-even like
    torch's .to(torch.bfloat16) by default; truncate keeps the top 16 bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    if not truncate:
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype(np.uint16)


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype_str, ndarray of the stored values)}, where a
    BF16 array holds uint16 bit patterns.  Header padded with spaces to 8."""
    np_types = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dt, arr) in tensors.items():
        data = np.ascontiguousarray(arr, dtype=np_types[dt]).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(np.uint64(len(hjson)).astype("<u8").tobytes())
        f.write(hjson)
        for b in blobs:
            f.write(b)


def make_config(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=None,
                vocab=128, head_dim=None, tied=False, llama3_rope=False,
                dtype="f32", eos=2):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_act": "silu", "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers,
           "num_attention_heads": heads,
           "num_key_value_heads": kv_heads if kv_heads else heads,
           "vocab_size": vocab, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": bool(tied), "bos_token_id": 1,
           "eos_token_id": eos, "attention_bias": False, "mlp_bias": False,
           "torch_dtype": {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[dtype],
           "rope_scaling": None}
    if head_dim:
        cfg["head_dim"] = head_dim
    if llama3_rope:
        # Chosen so a head_dim of 16 has frequencies in all three bands
        # (wavelengths 6..353 against band edges 16 and 64) and the effect
        # shows at short positions.
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}
    return cfg


def random_weights(cfg, seed=0):
    """{name: float32 array}.  Scales keep activations O(1) so greedy tokens
    are not decided by rounding-level logit gaps."""
    rng = np.random.default_rng(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H

    def lin(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = lin(H * hd, D)
        w[p + "self_attn.k_proj.weight"] = lin(KV * hd, D)
        w[p + "self_attn.v_proj.weight"] = lin(KV * hd, D)
        w[p + "self_attn.o_proj.weight"] = lin(D, H * hd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = lin(I, D)
        w[p + "mlp.up_proj.weight"] = lin(I, D)
        w[p + "mlp.down_proj.weight"] = lin(D, I)
    w["model.norm.weight"] = norm()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(V, D)
    return w


def encode(arr, dtype):
    """float32 array -> (safetensors dtype, stored values)."""
    if dtype == "bf16":
        return "BF16", f32_to_bf16_bits(arr)
    if dtype == "f16":
        return "F16", arr.astype(np.float16)
    return "F32", arr


def write_model(out_dir, cfg, weights, dtype="f32", shards=1):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    names = list(weights)
    if shards <= 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"),
                          {n: encode(weights[n], dtype) for n in names},
                          {"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]  # interleaved, so each shard has a mix
        write_safetensors(os.path.join(out_dir, fname),
                          {n: encode(weights[n], dtype) for n in part}, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="write a small random Llama checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--tied", action="store_true", help="tie_word_embeddings, no lm_head.weight")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: = heads")
    ap.add_argument("--llama3-rope", action="store_true", help="rope_scaling llama3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="> 1: sharded with an index")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=128)
    a = ap.parse_args(argv)
    cfg = make_config(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.vocab,
                      a.head_dim, a.tied, a.llama3_rope, a.dtype)
    write_model(a.out_dir, cfg, random_weights(cfg, a.seed), a.dtype, a.shards)
    print(a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
