#!/bin/bash
# Prefix-cache benchmark: the time to a first token of a long prompt whose
# prefix a replica has cached, against the same length computed whole, and
# a multi-turn chat workload (each turn resends the conversation so far) on
# a deployment with the cache and one without.  One CPU worker each (run one
# after the other, so they never share the cores); f32, 8 layers of hidden
# 512.  Prints every figure and the conditions.
#   bench/prefix.sh          about a minute on 2 cores
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
bench_setup bench/prefix.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker"
MODEL="$BUILD/models/prefix-bench"
[ -f "$MODEL/config.json" ] || "$BIN/tessera" model-init "$MODEL" --hidden 512 --intermediate 1376 \
    --layers 8 --heads 8 --kv-heads 4 --vocab 1024 --max-pos 4096 --seed 11 --force > /dev/null || exit 1
WP=$(free_port) CP=$(free_port)
cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$WP", control_endpoint: "tcp://127.0.0.1:$CP",
              security: none}
deployments:
  - name: cached
    model: $PWD/$MODEL
    max_seq_len: 4096
    prefill_chunk: 512
  - name: plain
    model: $PWD/$MODEL
    max_seq_len: 4096
    prefill_chunk: 512
    prefix_cache: false
YAML
"$BIN/tessera-coordinator" "$T/d.yaml" > "$T/coord.log" 2>&1 & PIDS+=($!)
for w in w0 w1; do
    "$BIN/tessera-worker" --coordinator "tcp://127.0.0.1:$WP" --name $w > "$T/$w.log" 2>&1 & PIDS+=($!)
done
"$BIN/tessera" --coordinator "tcp://127.0.0.1:$CP" status --wait-ready 60 > /dev/null ||
    { echo "bench/prefix.sh: not ready"; cat "$T"/*.log; exit 1; }

echo "== Prefix-cache benchmark"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: hidden 512, 8 layers, f32; one worker a deployment, prefill_chunk 512"
python3 - "$BIN/tessera" "tcp://127.0.0.1:$CP" <<'PY'
import random, re, statistics, subprocess, sys, time

cli, ep = sys.argv[1], sys.argv[2]
rng = random.Random(7)

def gen(dep, ids, max_tokens):
    """(first token ms, cached prompt tokens, token ids) of one request."""
    p = subprocess.run([cli, "--coordinator", ep, "generate", dep, "--prompt-ids",
                        ",".join(map(str, ids)), "--max-tokens", str(max_tokens)],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit("generate failed: " + p.stderr)
    m = re.search(r"first token after (\d+) ms \((\d+) of the prompt", p.stderr)
    return int(m.group(1)), int(m.group(2)), [int(x) for x in p.stdout.split()]

def prompt(n):
    return [rng.randrange(3, 1000) for _ in range(n)]

print("\ntime to first token, p50 of 5 (a new prompt each: no hit; the same prompt and 16")
print("new tokens: its prefix cached)")
for n in (1024, 3072):
    cold, warm, cached = [], [], []
    for _ in range(5):
        p = prompt(n)
        t, c, _ = gen("cached", p, 1)
        cold.append(t)
        t, c, _ = gen("cached", p + prompt(16), 1)
        warm.append(t)
        cached.append(c)
    c50, w50 = statistics.median(cold), statistics.median(warm)
    print("  %5d tokens: whole %6.0f ms, cached %5.0f ms (%d of %d cached): %.1fx faster"
          % (n, c50, w50, min(cached), n + 16, c50 / max(w50, 1)))

print("\nmulti-turn chat: 6 conversations of 4 turns, each turn the conversation so far, 200")
print("new prompt tokens and 32 generated; one request at a time, the conversations taking turns")
for dep in ("plain", "cached"):
    rng.seed(99)
    convs = [prompt(600) for _ in range(6)]
    t0 = time.monotonic()
    ttft, cached, total_prompt, tokens = [], 0, 0, []
    for turn in range(4):
        for k in range(6):
            t, c, out = gen(dep, convs[k], 32)
            ttft.append(t)
            cached += c
            total_prompt += len(convs[k])
            tokens.append(out)
            convs[k] = convs[k] + out + prompt(200)
    wall = time.monotonic() - t0
    print("  %-6s: %5.1f s in all, TTFT p50 %5.0f ms, %d of %d prompt tokens cached"
          % (dep, wall, statistics.median(ttft), cached, total_prompt))
    if dep == "plain":
        plain_tokens = tokens
    elif tokens != plain_tokens:
        sys.exit("the tokens differ with the cache")
print("  the same tokens with and without the cache")
PY
