#!/usr/bin/python3
"""selftest.py: checks llama_ref.py against properties any correct Llama
forward pass has, and against a deliberately naive loop implementation.
Exit 0 when all pass; the last line is "N passed, N failed".

    python3 tests/reference/selftest.py
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

try:
    import numpy as np
except ImportError:  # pragma: no cover - see llama_ref.py
    if os.path.exists("/usr/bin/python3") and \
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
import llama_ref as ref  # noqa: E402
import make_tiny as tiny  # noqa: E402

TMP = tempfile.mkdtemp(prefix="llama_ref_selftest.")
PROMPT = [1, 17, 42, 99, 5, 63, 7, 120]


def model_dir(name, **kw):
    """Writes (once) a tiny checkpoint under TMP and returns its directory."""
    d = os.path.join(TMP, name)
    if not os.path.exists(d):
        dtype, shards, seed = kw.pop("dtype", "f32"), kw.pop("shards", 1), kw.pop("seed", 0)
        cfg = tiny.make_config(dtype=dtype, **kw)
        tiny.write_model(d, cfg, tiny.random_weights(cfg, seed), dtype, shards)
    return d


def in_memory(cfg_kw, seed=0, edit=None):
    """A model built without files; edit(cfg, weights) may change either."""
    cfg = tiny.make_config(**cfg_kw)
    w = tiny.random_weights(cfg, seed)
    if edit:
        edit(cfg, w)
    return ref.build_model(ref.parse_config(cfg), w), cfg, w


# ---------------------------------------------------------------- (1) invariance
def test_generate_first_logits_are_last_row_of_forward():
    m = ref.load_model(model_dir("gqa", kv_heads=2))
    steps = []
    out = ref.generate(m, PROMPT, 4, (), steps)
    assert len(out) == 4 and len(steps) == 4
    assert np.array_equal(steps[0], ref.forward(m, PROMPT)[-1])
    for i, s in enumerate(steps):  # every step: last row over prompt + generated so far
        assert np.array_equal(s, ref.forward(m, PROMPT + out[:i])[-1])
        assert out[i] == int(np.argmax(s))


def test_causal_mask_future_tokens_do_not_matter():
    m = ref.load_model(model_dir("gqa", kv_heads=2))
    a = ref.forward(m, PROMPT)
    b = ref.forward(m, PROMPT[:5] + [3, 3, 3])
    assert np.allclose(a[:5], b[:5], rtol=0, atol=1e-12), "past rows changed"
    assert not np.allclose(a[5:], b[5:]), "changed tokens had no effect"
    # A prefix run equals the prefix rows of a longer run.
    assert np.allclose(ref.forward(m, PROMPT[:3]), a[:3], rtol=0, atol=1e-12)
    # And the mask is not too strict: the first token reaches the last row.
    c = ref.forward(m, [2] + PROMPT[1:])
    assert not np.allclose(a[-1], c[-1])


def test_cli_output_formats():
    d = model_dir("gqa", kv_heads=2)
    lf = os.path.join(TMP, "cli_logits.txt")
    r = subprocess.run([sys.executable, os.path.join(HERE, "llama_ref.py"), d,
                        "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "3",
                        "--logits-out", lf], capture_output=True, text=True, check=True)
    m = ref.load_model(d)
    steps = []
    out = ref.generate(m, PROMPT, 3, (), steps)
    assert r.stdout == ",".join(map(str, out)) + "\n", r.stdout
    first = np.array([float(x) for x in open(lf).read().split("\n") if x])
    assert first.shape == (m["config"]["vocab_size"],)
    assert np.allclose(first, steps[0], rtol=1e-8, atol=1e-12)
    rows = open(lf + ".all").read().splitlines()
    assert len(rows) == 3
    for row, s in zip(rows, steps):
        assert np.allclose([float(x) for x in row.split(" ")], s, rtol=1e-8, atol=1e-12)


def test_stop_at_eos():
    m = ref.load_model(model_dir("gqa", kv_heads=2))
    out = ref.generate(m, PROMPT, 5)
    stop = ref.generate(m, PROMPT, 5, (out[1],))
    assert stop == out[:out.index(out[1]) + 1]
    assert ref.parse_config(tiny.make_config(eos=[7, 9]))["eos_token_ids"] == [7, 9]


# ------------------------------------------------- (2) naive loop implementation
def naive_forward(cfg, w, ids):
    """Llama written as plainly as possible: per token, per head, explicit
    softmax over the visible positions, RoPE on explicit (i, i + hd/2) pairs.
    No llama3 scaling (tests use plain RoPE here)."""
    D, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = D // H, cfg["rms_norm_eps"], len(ids)
    group = H // KV
    W = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(v, g):
        return v / math.sqrt(sum(e * e for e in v) / len(v) + eps) * g

    def rope(vec, pos):
        out = vec.copy()
        for i in range(hd // 2):
            ang = pos / cfg["rope_theta"] ** (2 * i / hd)
            a, b = vec[i], vec[i + hd // 2]
            out[i] = a * math.cos(ang) - b * math.sin(ang)
            out[i + hd // 2] = b * math.cos(ang) + a * math.sin(ang)
        return out

    x = [W["model.embed_tokens.weight"][t].copy() for t in ids]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        h = [norm(x[t], W[p + "input_layernorm.weight"]) for t in range(T)]
        q = [[rope(W[p + "self_attn.q_proj.weight"][hh * hd:(hh + 1) * hd] @ h[t], t)
              for hh in range(H)] for t in range(T)]
        k = [[rope(W[p + "self_attn.k_proj.weight"][g * hd:(g + 1) * hd] @ h[t], t)
              for g in range(KV)] for t in range(T)]
        v = [[W[p + "self_attn.v_proj.weight"][g * hd:(g + 1) * hd] @ h[t]
              for g in range(KV)] for t in range(T)]
        for t in range(T):
            heads = []
            for hh in range(H):
                g = hh // group
                s = [float(q[t][hh] @ k[u][g]) / math.sqrt(hd) for u in range(t + 1)]
                e = [math.exp(si - max(s)) for si in s]
                heads.append(sum(e[u] / sum(e) * v[u][g] for u in range(t + 1)))
            x[t] = x[t] + W[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
        for t in range(T):
            n = norm(x[t], W[p + "post_attention_layernorm.weight"])
            gate = W[p + "mlp.gate_proj.weight"] @ n
            up = W[p + "mlp.up_proj.weight"] @ n
            act = np.array([gi / (1 + math.exp(-gi)) for gi in gate]) * up
            x[t] = x[t] + W[p + "mlp.down_proj.weight"] @ act
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    return np.array([head @ norm(x[t], W["model.norm.weight"]) for t in range(T)])


def test_mha_equals_naive_loops():
    m, cfg, w = in_memory({"kv_heads": None})
    assert np.allclose(ref.forward(m, PROMPT), naive_forward(cfg, w, PROMPT), rtol=0, atol=1e-10)


def test_gqa_equals_naive_loops():
    m, cfg, w = in_memory({"heads": 8, "kv_heads": 2}, seed=3)
    assert np.allclose(ref.forward(m, PROMPT), naive_forward(cfg, w, PROMPT), rtol=0, atol=1e-10)


def test_gqa_equals_mha_with_duplicated_kv_heads():
    gqa, cfg, w = in_memory({"heads": 8, "kv_heads": 2}, seed=4)
    hd = cfg["hidden_size"] // 8

    def expand(c, ww):  # head h gets a copy of KV head h // 4
        c["num_key_value_heads"] = 8
        for L in range(c["num_hidden_layers"]):
            for n in ("k_proj", "v_proj"):
                key = f"model.layers.{L}.self_attn.{n}.weight"
                ww[key] = np.concatenate([ww[key][(h // 4) * hd:(h // 4 + 1) * hd]
                                          for h in range(8)])
    mha, _, _ = in_memory({"heads": 8, "kv_heads": 2}, seed=4, edit=expand)
    assert mha["config"]["num_key_value_heads"] == 8
    assert np.allclose(ref.forward(gqa, PROMPT), ref.forward(mha, PROMPT), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------- (3) RoPE
def test_rope_depends_only_on_relative_position():
    rng = np.random.default_rng(7)
    for kw in ({}, {"llama3_rope": True}):
        cfg = ref.parse_config(tiny.make_config(hidden=64, heads=4, **kw))  # hd 16
        inv = ref.rope_inv_freq(cfg)
        q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))

        def rot(x, pos):
            cos, sin = ref.rope_cos_sin(inv, [pos])
            return ref.apply_rope(x, cos, sin)[0, 0]

        for delta in (0, 1, 5, 37):
            dots = [rot(q, p + delta) @ rot(k, p) for p in (0, 3, 11, 100, 1000)]
            assert np.allclose(dots, dots[0], rtol=0, atol=1e-9), (delta, dots)
        assert np.allclose(rot(q, 0), q[0, 0])                          # position 0: identity
        assert np.isclose(np.linalg.norm(rot(q, 9)), np.linalg.norm(q))  # a rotation


def test_rope_pairs_i_with_i_plus_half():
    # rotate_half convention (not interleaved pairs): dims i and i + hd/2.
    inv = ref.rope_inv_freq(ref.parse_config(tiny.make_config(hidden=64, heads=4)))
    x = np.random.default_rng(8).standard_normal((1, 1, 16))
    cos, sin = ref.rope_cos_sin(inv, [6])
    y = ref.apply_rope(x, cos, sin)[0, 0]
    a, b, ang = x[0, 0, :8], x[0, 0, 8:], 6 * inv
    assert np.allclose(y[:8], a * np.cos(ang) - b * np.sin(ang))
    assert np.allclose(y[8:], b * np.cos(ang) + a * np.sin(ang))


# ----------------------------------------------------------------- (4) bf16, f16
def test_bf16_loading_is_exact_truncation():
    vals = np.array([1.0, -2.5, 3.14159265, 1e-20, -6.5e30, 0.0, 123.456], np.float32)
    rnd = np.random.default_rng(9).standard_normal((3, 5)).astype(np.float32)
    path = os.path.join(TMP, "bf16.safetensors")
    tiny.write_safetensors(path, {"v": ("BF16", tiny.f32_to_bf16_bits(vals, truncate=True)),
                                  "r": ("BF16", tiny.f32_to_bf16_bits(rnd, truncate=True)),
                                  "h": ("F16", rnd.astype(np.float16)), "f": ("F32", rnd)})
    t = ref.read_safetensors(path)
    for name, src in (("v", vals), ("r", rnd)):
        want = (src.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        assert t[name].dtype == np.float32 and t[name].shape == src.shape
        assert np.array_equal(t[name], want), name
    assert t["v"][0] == 1.0 and t["v"][1] == -2.5 and t["v"][2] == 3.140625
    assert np.array_equal(t["h"], rnd.astype(np.float16).astype(np.float32))
    assert np.array_equal(t["f"], rnd)


def test_bf16_checkpoint_equals_rounded_f32_weights():
    m = ref.load_model(model_dir("bf16", dtype="bf16", kv_heads=2))
    cfg = tiny.make_config(kv_heads=2)

    def bf16_round(c, w):
        for n in w:
            w[n] = (tiny.f32_to_bf16_bits(w[n]).astype(np.uint32) << 16).view(np.float32)
    same, _, _ = in_memory({"kv_heads": 2}, edit=bf16_round)
    assert np.array_equal(ref.forward(m, PROMPT), ref.forward(same, PROMPT))
    plain = ref.build_model(ref.parse_config(cfg), tiny.random_weights(cfg, 0))
    assert not np.array_equal(ref.forward(m, PROMPT), ref.forward(plain, PROMPT))


def test_bad_offsets_are_refused():
    path = os.path.join(TMP, "bad.safetensors")
    tiny.write_safetensors(path, {"a": ("F32", np.zeros(4, np.float32))})
    raw = open(path, "rb").read().replace(b"[0,16]", b"[0,12]")
    open(path, "wb").write(raw)
    try:
        ref.read_safetensors(path)
    except ValueError:
        return
    raise AssertionError("mismatched data_offsets accepted")


def test_sharded_index_equals_single_file():
    a = ref.load_model(model_dir("gqa", kv_heads=2))
    b = ref.load_model(model_dir("gqa_sharded", kv_heads=2, shards=3))
    assert os.path.exists(os.path.join(model_dir("gqa_sharded"), "model.safetensors.index.json"))
    assert np.array_equal(ref.forward(a, PROMPT), ref.forward(b, PROMPT))


def test_f32_close_to_f64():
    d = model_dir("gqa", kv_heads=2)
    a = ref.forward(ref.load_model(d), PROMPT)
    b = ref.forward(ref.load_model(d, np.float32), PROMPT)
    assert b.dtype == np.float32 and np.allclose(a, b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- (5) llama3 RoPE
def test_bf16_rounding_is_to_nearest_ties_to_even():
    # spacing 2^-7 at 1: 1 + 2^-8 is halfway (to the even 1.0), 1 + 3 * 2^-9
    # is above halfway, 1 + 3 * 2^-8 halfway again (to the even 1 + 2^-6)
    a = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-9, 1 + 3 * 2**-8, -3.14159, 0.0])
    want = np.array([1.0, 1.0, 1 + 2**-7, 1 + 2**-6, -3.140625, 0.0])
    assert np.array_equal(ref.round_bf16(a), want)


def test_int8_rounding_is_per_row_to_nearest_ties_to_even():
    # scale = max |row| / 127: 1 for the first row (ties at 0.5, 1.5, 2.5 go
    # to the even 0, 2, 2), 2 for the second; a zero row stays zero; a row
    # with a NaN or an infinity reads back as NaN throughout
    a = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -127.0, 3.2, 0.0],
                  [254.0, 1.0, 3.0, 5.0, -1.0, -254.0, 6.4, 0.0],
                  [0.0] * 8,
                  [1.0, np.nan, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                  [1.0, np.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    want = np.array([[127.0, 0.0, 2.0, 2.0, 0.0, -127.0, 3.0, 0.0],
                     [254.0, 0.0, 4.0, 4.0, 0.0, -254.0, 6.0, 0.0],
                     [0.0] * 8])
    got = ref.round_int8(a)
    assert np.array_equal(got[:3], want), got[:3]
    assert np.isnan(got[3:]).all(), got[3:]


def test_a_bf16_kv_cache_moves_logits_a_little():
    m = ref.load_model(model_dir("gqa", kv_heads=2))
    full = ref.forward(m, PROMPT)
    m["kv_round"] = ref.round_bf16
    rounded = ref.forward(m, PROMPT)
    diff = np.abs(full - rounded).max()
    assert 0 < diff < 0.01 * np.abs(full).max(), diff


def test_bf16_matmuls_round_weights_and_inputs_and_move_logits_a_little():
    m = ref.load_model(model_dir("gqa", kv_heads=2))
    full = ref.forward(m, PROMPT)
    ref.round_matmuls(m, ref.round_bf16)
    for layer in m["layers"]:   # every matrix now holds bf16 values
        assert np.array_equal(layer["down_proj"], ref.round_bf16(layer["down_proj"]))
    assert np.array_equal(m["lm_head"], ref.round_bf16(m["lm_head"]))
    rounded = ref.forward(m, PROMPT)
    diff = np.abs(full - rounded).max()
    assert 0 < diff < 0.05 * np.abs(full).max(), diff
    # the inputs are rounded too: without x_round the logits differ again
    m.pop("x_round")
    assert not np.array_equal(ref.forward(m, PROMPT), rounded)


def test_llama3_scaling_bands():
    cfg = ref.parse_config(tiny.make_config(hidden=64, heads=4, llama3_rope=True))
    rs = cfg["rope_scaling"]
    base = ref.rope_inv_freq(dict(cfg, rope_scaling=None))
    scaled = ref.rope_inv_freq(cfg)
    wavelen = 2 * np.pi / base
    orig = rs["original_max_position_embeddings"]
    high = wavelen < orig / rs["high_freq_factor"]
    low = wavelen > orig / rs["low_freq_factor"]
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any(), "tiny config should hit every band"
    assert np.array_equal(scaled[high], base[high])
    assert np.allclose(scaled[low], base[low] / rs["factor"], rtol=1e-15)
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / rs["factor"])
    # The blend is continuous at both band edges.
    f = np.array([2 * np.pi / (orig / rs["high_freq_factor"]), 2 * np.pi / (orig / rs["low_freq_factor"])])
    edge = ref.llama3_scale_inv_freq(f, rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], orig)
    assert np.allclose(edge, [f[0], f[1] / rs["factor"]])
    # And the model uses it.
    m = ref.load_model(model_dir("llama3", llama3_rope=True))
    assert np.allclose(m["inv_freq"], scaled)
    plain, _, _ = in_memory({})
    assert not np.allclose(ref.forward(m, PROMPT), ref.forward(plain, PROMPT))


# ------------------------------------------------------------------- (6) tied
def test_tied_embeddings_use_embed_tokens():
    d = model_dir("tied", tied=True)
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        names = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    m = ref.load_model(d)
    assert m["lm_head"] is m["embed_tokens"]

    def untie(c, w):  # same weights, but an explicit lm_head copied from the embedding
        c["tie_word_embeddings"] = False
        w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    untied, cfg, w = in_memory({"tied": True}, edit=untie)
    assert np.array_equal(ref.forward(m, PROMPT), ref.forward(untied, PROMPT))
    assert np.allclose(ref.forward(m, PROMPT), naive_forward(dict(cfg, tie_word_embeddings=True), w, PROMPT),
                       rtol=0, atol=1e-10)

    def garbage_head(c, w):  # tied: a stray lm_head.weight in the file is ignored, as in HF
        w["lm_head.weight"] = np.zeros_like(w["model.embed_tokens.weight"])
    stray, _, _ = in_memory({"tied": True}, edit=garbage_head)
    assert np.array_equal(ref.forward(m, PROMPT), ref.forward(stray, PROMPT))
    try:  # untied without lm_head.weight is an error, not a silent tie
        in_memory({"tied": True}, edit=lambda c, w: c.update(tie_word_embeddings=False))
    except KeyError:
        return
    raise AssertionError("missing lm_head.weight accepted")


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]
    passed = failed = 0
    for name, fn in tests:
        try:
            fn()
            passed += 1
            print(f"PASS {name}")
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
    shutil.rmtree(TMP, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
