# A damaged checkpoint: the worker reports failed, and `tessera status` shows
# the reason, naming the file and the tensor.
source "$(dirname "$0")/lib.sh"
write_yaml "$T/d.yaml" 1 1 1 tiny "$T/bad"
cp -r "$MODEL" "$T/bad"   # the coordinator reads its config.json at start
start_coord "$T/d.yaml"
answers() { status_json > /dev/null; }
wait_until 5 answers || fail "coordinator not up"

# damage KIND: a fresh copy of the model in $T/bad, damaged one way.
damage() {
    rm -rf "$T/bad"; cp -r "$MODEL" "$T/bad"
    python3 - "$T/bad" "$1" <<'PY'
import json, struct, sys
d, kind = sys.argv[1], sys.argv[2]
path = d + "/model.safetensors"
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr, data = json.loads(raw[8:8 + n]), raw[8 + n:]
def write(h, body):
    j = json.dumps(h).encode()
    open(path, "wb").write(struct.pack("<Q", len(j)) + j + body)
if kind == "truncated":
    open(path, "wb").write(raw[: len(raw) // 2])
elif kind == "badjson":
    open(path, "wb").write(raw[:8] + b"{not json" + raw[17:])
elif kind == "offsets":
    hdr["model.norm.weight"]["data_offsets"] = [len(data) + 64, len(data) + 64 + 256]
    write(hdr, data)
elif kind == "missing":
    del hdr["model.layers.3.mlp.up_proj.weight"]
    write(hdr, data)
elif kind == "shape":
    c = json.load(open(d + "/config.json")); c["intermediate_size"] = 96
    json.dump(c, open(d + "/config.json", "w"))
PY
}

# expect KIND PATTERN: the worker fails with a reason matching PATTERN.
expect() {
    damage "$1"
    start_worker "w-$1"
    pat="$2"
    shows() { status_json | jget "d['deployments'][0]['state'] + ': ' + d['deployments'][0]['message']" | grep -qE "$pat"; }
    wait_until 10 shows || fail "$1: status shows $(status_json | jget "d['deployments'][0]['message']")"
    echo "$1: $(status_json | jget "d['deployments'][0]['message']")"
    kill "${WPID[w-$1]}"; wait "${WPID[w-$1]}" 2>/dev/null
    victim="w-$1"
    gone() { [ "$(worker_field "$victim" state)" = dead ]; }
    wait_until 5 gone || fail "worker w-$1 did not go"
}
expect truncated "^failed: .*bad/model.safetensors: .*(truncated|shorter|outside|exceeds|larger)"
expect badjson "^failed: .*bad/model.safetensors: .*JSON"
expect offsets "^failed: .*bad/model.safetensors: tensor model.norm.weight: .*outside"
expect missing "^failed: .*tensor model.layers.3.mlp.up_proj.weight: missing"
expect shape "^failed: .*model.layers.0.mlp.gate_proj.weight: shape .* does not match"
ok "truncated file, bad JSON, offsets outside, missing tensor and wrong shape reported in status"
