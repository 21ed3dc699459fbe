# matmul_dtype: a reload to bf16 reaches the worker (its weights are loaded
# again, in half the bytes, as tessera plan says), status shows the type
# configured and in use,
# generation then matches the NumPy reference with weights and the products'
# inputs rounded to bf16, and an unknown value is refused naming file, line
# and key while the deployment keeps serving.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"
start_worker w0
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
wbytes() { status_json | jget "min(w.get('weight_bytes', 0) for w in d['workers'])"; }
mm() { status_json | jget "d['deployments'][0]['matmul_dtype']"; }
mm_used() { status_json | jget "d['deployments'][0]['matmul_dtype_used']"; }
reported() { [ "$(wbytes)" -gt 0 ]; }
wait_until 5 reported || fail "no weight bytes: $(status_json)"
f32=$(wbytes)
[ "$(mm)" = auto ] && [ "$(mm_used)" = f32 ] || fail "matmul_dtype shown as $(mm), in use $(mm_used)"

"$BIN/tessera" plan "$T/d.yaml" | grep -q "(4-byte parameters)" || fail "plan: $("$BIN/tessera" plan "$T/d.yaml")"
sed -i 's/    max_seq_len: 256/    max_seq_len: 256\n    matmul_dtype: bf16/' "$T/d.yaml"
# tessera plan costs what the engine will hold, not the checkpoint's type
"$BIN/tessera" plan "$T/d.yaml" | grep -q "(2-byte parameters)" || fail "plan: $("$BIN/tessera" plan "$T/d.yaml")"
tsr reload > "$T/reload.txt" || fail "reload failed: $(cat "$T/reload.txt")"
# norm weights stay f32: a little over half
halved() { local b; b=$(wbytes); [ "$((2 * b))" -ge "$f32" ] && [ "$((2 * b))" -lt "$((f32 + f32 / 20))" ] && all_ready; }
wait_until 15 halved || fail "bf16 weights: $(wbytes) bytes, f32 had $f32"
[ "$(mm)" = bf16 ] && [ "$(mm_used)" = bf16 ] || fail "matmul_dtype shown as $(mm), in use $(mm_used)"
ok "weights: $f32 bytes in f32, $(wbytes) in bf16"

expect_reference_tokens --matmul-dtype bf16
ok "bf16 products' tokens equal the reference's with the same rounding"

expect_dtype_reload_refused matmul_dtype bf16 int8
