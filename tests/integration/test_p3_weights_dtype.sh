# weights_dtype int8: a reload reaches the worker (its weights are read
# again, in about a quarter of the f32 bytes, as tessera plan says), status
# shows the type, generation then matches the NumPy reference with the same
# quantization, a reload back to auto restores the f32 tokens, and an
# unknown value is refused naming file, line and key while the deployment
# keeps serving.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1
start_coord "$T/d.yaml"
start_worker w0
wait_until 15 all_ready || fail "not ready: $(tsr status 2>&1)"
wbytes() { status_json | jget "min(w.get('weight_bytes', 0) for w in d['workers'])"; }
wt() { status_json | jget "d['deployments'][0]['weights_dtype']"; }
reported() { [ "$(wbytes)" -gt 0 ]; }
wait_until 5 reported || fail "no weight bytes: $(status_json)"
f32=$(wbytes)
[ "$(wt)" = auto ] || fail "weights_dtype shown as $(wt)"
tsr status | grep -q "^  weights " && fail "tessera status shows number formats for defaults: $(tsr status)"
expect_reference_tokens
f32_tokens=$(tsr generate tiny --prompt-ids 9,4,2 --max-tokens 16 --ids) || fail "generate failed"

sed -i 's/    max_seq_len: 256/    max_seq_len: 256\n    weights_dtype: int8/' "$T/d.yaml"
"$BIN/tessera" plan "$T/d.yaml" | grep -q "(1-byte parameters: int8, and a 4-byte scale a row)" ||
    fail "plan: $("$BIN/tessera" plan "$T/d.yaml")"
tsr reload > "$T/reload.txt" || fail "reload failed: $(cat "$T/reload.txt")"
# norm weights stay f32 and each row has a scale: a little over a quarter
quartered() { local b; b=$(wbytes); [ "$((4 * b))" -ge "$f32" ] && [ "$((4 * b))" -lt "$((f32 + f32 / 8))" ] && all_ready; }
wait_until 15 quartered || fail "int8 weights: $(wbytes) bytes, f32 had $f32"
[ "$(wt)" = int8 ] || fail "weights_dtype shown as $(wt)"
tsr status | grep -q "^  weights int8 (a scale a row, integer products), KV cache f32$" ||
    fail "tessera status does not show the weight type: $(tsr status)"
ok "weights: $f32 bytes in f32, $(wbytes) in int8"

expect_reference_tokens --weights-dtype int8
ok "int8 weights' tokens equal the reference's with the same quantization"

expect_dtype_reload_refused weights_dtype int8 fp8
sed -i 's/    weights_dtype: fp8/    weights_dtype: int8/' "$T/d.yaml"

sed -i 's/    weights_dtype: int8/    weights_dtype: auto/' "$T/d.yaml"
tsr reload > "$T/reload.txt" || fail "reload back failed: $(cat "$T/reload.txt")"
back() { [ "$(wbytes)" = "$f32" ] && all_ready; }
wait_until 15 back || fail "back to auto: $(wbytes) bytes, f32 had $f32"
got=$(tsr generate tiny --prompt-ids 9,4,2 --max-tokens 16 --ids) || fail "generate failed"
[ "$got" = "$f32_tokens" ] || fail "back to f32 weights: $got, before $f32_tokens"
ok "back to auto: $f32 bytes and the f32 tokens again"
