# kv_dtype: a deployment's KV cache in bf16 holds twice the blocks of the
# same kv_cache_mib in f32, a reload that changes it reaches the worker (its
# pool is rebuilt), and generation then matches the NumPy reference with
# keys and values rounded to bf16; in int8, more than three times the
# blocks, and the reference's tokens with keys and values rounded to int8
# rows.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
sed -i 's/    max_seq_len: 256/    max_seq_len: 256\n    kv_cache_mib: 1/' "$T/d.yaml"
start_coord "$T/d.yaml"
start_worker w0
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
total() { status_json | jget "min(w.get('kv_blocks_total', 0) for w in d['workers'])"; }
kv_dtype() { status_json | jget "d['deployments'][0]['kv_dtype']"; }
kv_dtype_used() { status_json | jget "d['deployments'][0]['kv_dtype_used']"; }
reported() { [ "$(total)" -gt 0 ]; }   # with the first heartbeat after loading
wait_until 5 reported || fail "no KV blocks: $(status_json)"
f32=$(total)
[ "$(kv_dtype)" = auto ] || fail "kv_dtype shown as $(kv_dtype), not auto"
[ "$(kv_dtype_used)" = f32 ] || fail "kv_dtype_used shown as $(kv_dtype_used), not f32 (auto on a cpu)"

sed -i 's/    kv_cache_mib: 1/    kv_cache_mib: 1\n    kv_dtype: bf16/' "$T/d.yaml"
tsr reload > "$T/reload.txt" || fail "reload failed: $(cat "$T/reload.txt")"
doubled() { [ "$(total)" = $((2 * f32)) ] && all_ready; }
wait_until 15 doubled || fail "bf16 pool: $(total) blocks, f32 had $f32"
[ "$(kv_dtype)" = bf16 ] && [ "$(kv_dtype_used)" = bf16 ] ||
    fail "kv_dtype shown as $(kv_dtype), in use $(kv_dtype_used)"
ok "1 MiB holds $f32 blocks in f32, $(total) in bf16"

expect_reference_tokens --kv-dtype bf16
ok "bf16 KV tokens equal the reference's"

# A value the worker does not know never gets that far: the YAML names it.
expect_dtype_reload_refused kv_dtype bf16 fp8

# int8: head_dim + 4 bytes a row (one position of one KV head) against
# f32's 4 * head_dim, so 1 MiB holds 2^20 / (2 * layers * kv heads * 16 *
# (head_dim + 4)) blocks, and generation matches the reference with keys and
# values rounded as that cache holds them.
sed -i 's/    kv_dtype: fp8/    kv_dtype: int8/' "$T/d.yaml"   # the refused edit is still in the file
tsr reload > "$T/reload.txt" || fail "reload to int8 failed: $(cat "$T/reload.txt")"
want=$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))
hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
print((1 << 20) // (2 * c["num_hidden_layers"] * c["num_key_value_heads"] * 16 * (hd + 4)))' \
       "$MODEL/config.json")
as_int8() { [ "$(total)" = "$want" ] && [ "$(kv_dtype_used)" = int8 ] && all_ready; }
wait_until 15 as_int8 || fail "int8 pool: $(total) blocks ($(kv_dtype_used)), want $want; f32 had $f32"
ok "1 MiB holds $(total) blocks in int8"
expect_reference_tokens --kv-dtype int8
ok "int8 KV tokens equal the reference's"
