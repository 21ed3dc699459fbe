# The CLI and daemons fail clearly on bad arguments and unreachable peers.
source "$(dirname "$0")/lib.sh"
"$BIN/tessera" --coordinator "tcp://127.0.0.1:$WPORT" --timeout 300 status 2> "$T/e.txt"; rc=$?
[ "$rc" = 1 ] || fail "status without coordinator exited $rc"
grep -q "no answer from the coordinator at tcp://127.0.0.1:$WPORT within 300 ms" "$T/e.txt" || fail "$(cat "$T/e.txt")"
"$BIN/tessera" frobnicate 2> "$T/e.txt"; [ $? = 2 ] || fail "unknown command should exit 2"
grep -q "unknown command 'frobnicate'" "$T/e.txt" || fail "unknown command message"
for c in status workers plan reload drain undrain local generate model-init tokenize version; do
    "$BIN/tessera" $c --help > "$T/h.txt" || fail "$c --help failed"
    grep -q "usage: tessera" "$T/h.txt" || fail "$c --help has no usage line"
done
# tokenize: a directory without tokenizer.json, and ids that are not ids.
"$BIN/tessera" tokenize "$T/none" hello 2> "$T/e.txt"; [ $? = 1 ] || fail "tokenize without a tokenizer"
grep -q "$T/none/tokenizer.json: No such file" "$T/e.txt" || fail "tokenize: $(cat "$T/e.txt")"
"$BIN/tessera" model-init "$T/tm" --hidden 64 --intermediate 128 --layers 2 --heads 8 --kv-heads 4 \
    --vocab 1024 > /dev/null || fail "model-init"
"$BIN/tessera" tokenize "$T/tm" --decode 1,x 2> "$T/e.txt"; [ $? = 1 ] || fail "bad ids accepted"
grep -q "'x' is not a token id" "$T/e.txt" || fail "tokenize --decode: $(cat "$T/e.txt")"
"$BIN/tessera" tokenize "$T/tm" --decode 1,,2 2> "$T/e.txt"; [ $? = 1 ] || fail "an empty id accepted"
[ "$("$BIN/tessera" tokenize "$T/tm" --decode "$("$BIN/tessera" tokenize "$T/tm" --no-special "héllo wörld")")" = \
  "héllo wörld" ] || fail "tokenize did not round-trip"
"$BIN/tessera" tokenize "$T/tm" --decode 5,1024 2> "$T/e.txt"; [ $? = 1 ] || fail "an id past the vocabulary decoded"
grep -q "id 1024 (number 2) is not in the tokenizer's vocabulary of 1024 ids" "$T/e.txt" ||
    fail "tokenize --decode 1024: $(cat "$T/e.txt")"
printf '{"ids": [5, 1024]}\n' | "$BIN/tessera" tokenize "$T/tm" --jsonl | grep -q '"ids\[1\]: not a token id' ||
    fail "tokenize --jsonl decoded an id past the vocabulary"
# a malformed endpoint is refused at once, saying what is wrong with it
"$BIN/tessera" --coordinator tcp://127.0.0.1:99999 status 2> "$T/e.txt"; [ $? = 2 ] || fail "port 99999 accepted"
grep -q "the port '99999' is not a number from 1 to 65535" "$T/e.txt" || fail "$(cat "$T/e.txt")"
TESSERA_COORDINATOR="tcp://127.0.0.1:7401junk" "$BIN/tessera" status 2> "$T/e.txt"; [ $? = 2 ] ||
    fail "a port with junk after it accepted"
"$BIN/tessera-worker" --coordinator "tcp://[::1:7400" 2> "$T/e.txt"; [ $? = 1 ] || fail "worker: bad endpoint accepted"
grep -q "no closing ']'" "$T/e.txt" || fail "$(cat "$T/e.txt")"
# generate: the value out of its range is named; an empty id between commas is refused.
G=("$BIN/tessera" --coordinator "tcp://127.0.0.1:$WPORT" --timeout 300 generate tiny)
"${G[@]}" --prompt-ids 1 --max-tokens 0 2> "$T/e.txt"; [ $? = 2 ] || fail "--max-tokens 0 accepted"
grep -q -- "--max-tokens: expected 1 to 1000000, got 0" "$T/e.txt" || fail "$(cat "$T/e.txt")"
"${G[@]}" --prompt-ids 1 --top-p 2 2> "$T/e.txt"; [ $? = 2 ] || fail "--top-p 2 accepted"
grep -q -- "--top-p: expected above 0, at most 1, got 2" "$T/e.txt" || fail "$(cat "$T/e.txt")"
"${G[@]}" --prompt-ids 1,,2 2> "$T/e.txt"; [ $? = 1 ] || fail "--prompt-ids 1,,2 accepted"
grep -q -- "--prompt-ids: an empty id at ',,2'" "$T/e.txt" || fail "$(cat "$T/e.txt")"
"$BIN/tessera-coordinator" --help | grep -q "usage: tessera-coordinator" || fail "coordinator --help"
"$BIN/tessera-worker" --help | grep -q "usage: tessera-worker" || fail "worker --help"
"$BIN/tessera-worker" --device tpu 2> "$T/e.txt"; [ $? = 1 ] || fail "bad device accepted"
grep -q "expected cpu or cuda, got 'tpu'" "$T/e.txt" || fail "bad device message"
"$BIN/tessera-worker" --mem-gbs fast 2> "$T/e.txt"; [ $? = 1 ] || fail "--mem-gbs fast accepted"
grep -q -- "--mem-gbs: expected a number above 0 and at most 1e9, got 'fast'" "$T/e.txt" || fail "bad rate message: $(cat "$T/e.txt")"
TESSERA_GFLOPS=-1 "$BIN/tessera-worker" 2> "$T/e.txt"; [ $? = 1 ] || fail "TESSERA_GFLOPS=-1 accepted"
grep -q "TESSERA_GFLOPS: expected a number" "$T/e.txt" || fail "bad env rate message: $(cat "$T/e.txt")"
# A coordinator with a bad file does not start, and says where the fault is.
printf 'version: 1\ncoordinator:\n  heartbeat_ms: 5\n' > "$T/bad.yaml"
"$BIN/tessera-coordinator" "$T/bad.yaml" 2> "$T/e.txt"; [ $? = 1 ] || fail "bad file accepted"
grep -q "bad.yaml:3:3: coordinator.heartbeat_ms: unknown key" "$T/e.txt" || fail "$(cat "$T/e.txt")"
# --check validates without starting.
write_yaml "$T/d.yaml" 2 2 1
"$BIN/tessera-coordinator" --check "$T/d.yaml" > "$T/c.txt" || fail "check failed: $(cat "$T/c.txt")"
write_yaml "$T/d3.yaml" 3 1 1
"$BIN/tessera-coordinator" --check "$T/d3.yaml" 2> "$T/e.txt"; [ $? = 1 ] || fail "tp=3 accepted for 8 heads"
grep -q "num_attention_heads 8 is not divisible by parallel.tensor 3" "$T/e.txt" || fail "$(cat "$T/e.txt")"
# --check refuses what a start would: an API keys file others can read.
printf 'sk-check-0123456789abcdef\n' > "$T/api.keys"; chmod 644 "$T/api.keys"
sed "s|^coordinator:|coordinator:\n  http_endpoint: 127.0.0.1:8000\n  api_keys_file: $T/api.keys|" "$T/d.yaml" > "$T/k.yaml"
"$BIN/tessera-coordinator" --check "$T/k.yaml" > /dev/null 2> "$T/e.txt"; [ $? = 1 ] || fail "--check passed a keys file of mode 644"
grep -q "api.keys: mode 644" "$T/e.txt" || fail "$(cat "$T/e.txt")"
chmod 600 "$T/api.keys"
"$BIN/tessera-coordinator" --check "$T/k.yaml" > /dev/null 2> "$T/e.txt" || fail "check with a private keys file: $(cat "$T/e.txt")"
# ...and a coordinator secret key others can read, with the start's own words.
chmod 644 "$KEYS/coordinator.key"
"$BIN/tessera-coordinator" --check "$T/d.yaml" > /dev/null 2> "$T/e.txt"; rc=$?
"$BIN/tessera-coordinator" "$T/d.yaml" > /dev/null 2> "$T/s.txt"; src=$?
chmod 600 "$KEYS/coordinator.key"
[ $rc = 1 ] || fail "--check passed a coordinator.key of mode 0644 (exit $rc)"
[ $src = 1 ] || fail "a start with a coordinator.key of mode 0644 exited $src"
grep -q "coordinator.key.*0644" "$T/e.txt" || fail "--check does not name the key file and its mode: $(cat "$T/e.txt")"
grep -qF "$(cat "$T/e.txt")" "$T/s.txt" || fail "--check and the start refuse differently:
check: $(cat "$T/e.txt")
start: $(cat "$T/s.txt")"
# ...and a key store others may change, each refused by --check as by a start, naming
# the path and its mode (or owner): whoever may write there chooses who is let in.
check_and_start_refuse() {  # what; the path and words the refusal must name
    "$BIN/tessera-coordinator" --check "$T/d.yaml" > /dev/null 2> "$T/e.txt"; rc=$?
    # (a start that is not refused runs on: the limit turns that into a failure)
    timeout 10 "$BIN/tessera-coordinator" "$T/d.yaml" > /dev/null 2> "$T/s.txt"; src=$?
    [ $rc = 1 ] || fail "--check passed $1 (exit $rc)"
    [ $src = 1 ] || fail "a start with $1 exited $src"
    grep -qF "$2" "$T/e.txt" || fail "--check does not say '$2' for $1: $(cat "$T/e.txt")"
    grep -qF "$(cat "$T/e.txt")" "$T/s.txt" || fail "--check and the start refuse $1 differently:
check: $(cat "$T/e.txt")
start: $(cat "$T/s.txt")"
}
chmod 777 "$KEYS/allowed"
check_and_start_refuse "allowed/ of mode 0777" "$KEYS/allowed: a key directory must not be writable by group or others, but its mode is 0777"
chmod 755 "$KEYS/allowed"; chmod 777 "$KEYS"
check_and_start_refuse "a key store of mode 0777" "$KEYS: a key directory must not be writable by group or others, but its mode is 0777"
chmod 755 "$KEYS"; chown 65534 "$KEYS/allowed"
check_and_start_refuse "allowed/ owned by nobody" "$KEYS/allowed: a key directory must be owned by uid $(id -u)"
chown "$(id -u)" "$KEYS/allowed"
"$BIN/tessera" keys add "$KEYS" evil > /dev/null || fail "keys add evil"
chmod 666 "$KEYS/allowed/evil.pub"
check_and_start_refuse "allowed/evil.pub of mode 0666" "$KEYS/allowed/evil.pub: a key file must not be writable by group or others, but its mode is 0666"
"$BIN/tessera" keys remove "$KEYS" evil > /dev/null || fail "keys remove evil"
chmod 666 "$KEYS/coordinator.pub"
check_and_start_refuse "coordinator.pub of mode 0666" "$KEYS/coordinator.pub: a key file must not be writable by group or others, but its mode is 0666"
chmod 644 "$KEYS/coordinator.pub"
# keys list names a file it cannot read as a key, and lists the rest.
echo garbage > "$KEYS/allowed/zz.pub"
"$BIN/tessera" keys list "$KEYS" > "$T/o.txt" 2> "$T/e.txt" || fail "keys list with a bad file: $(cat "$T/e.txt")"
grep -q "zz.pub" "$T/e.txt" || fail "keys list does not name zz.pub: $(cat "$T/e.txt")"
grep -q "^cli " "$T/o.txt" || fail "keys list left out the good keys: $(cat "$T/o.txt")"
rm "$KEYS/allowed/zz.pub"
"$BIN/tessera-coordinator" --check "$T/d.yaml" > /dev/null 2> "$T/e.txt" || fail "check of the restored store: $(cat "$T/e.txt")"
# A coordinator whose model directory lacks config.json still starts, and
# status says why that deployment is not placed.
write_yaml "$T/m.yaml" 1 1 1 tiny "$T/nomodel"
start_coord "$T/m.yaml"
start_worker w0
failed_msg() { status_json | jget "d['deployments'][0]['state'] + ': ' + d['deployments'][0]['message']" | grep -qE "failed: .*m.yaml:[0-9]+:[0-9]+: deployments\[0\] \(tiny\): .*nomodel/config.json"; }
wait_until 5 failed_msg || fail "missing model not reported: $(status_json | jget "d['deployments'][0]")"
"$BIN/tessera-worker" --name 'bad name' 2> "$T/e.txt"; [ $? = 1 ] || fail "a name with a space accepted"
grep -q "must be 1 to 128 of A-Z a-z 0-9" "$T/e.txt" || fail "$(cat "$T/e.txt")"
# model-init: sizes each in range that together ask for more than the disk has are
# refused before anything is written; an interrupted run leaves no partial file.
"$BIN/tessera" model-init "$T/huge" --hidden 65536 --intermediate 65536 --layers 1000 2> "$T/e.txt"
[ $? = 1 ] && grep -q "the model needs .* GiB; the filesystem of .* GiB free" "$T/e.txt" ||
    fail "a model larger than the disk: $(cat "$T/e.txt")"
[ -e "$T/huge" ] && fail "the refused model-init left $T/huge"
"$BIN/tessera" model-init "$T/big" --dtype bf16 --hidden 1024 --intermediate 4096 --layers 8 \
    --heads 8 --kv-heads 4 --vocab 1024 > /dev/null 2>&1 &
MI=$!
tmp_there() { ls "$T/big"/*.tmp > /dev/null 2>&1; }
if wait_until 10 tmp_there; then
    kill -TERM "$MI"; wait "$MI" 2>/dev/null   # (a script's background job ignores SIGINT)
    ls "$T/big"/*.tmp > /dev/null 2>&1 && fail "an interrupted model-init left $(ls "$T/big")"
else
    wait "$MI"   # it finished before it was seen writing: nothing to interrupt
fi
ok "clear errors for bad arguments, names, files and peers"
