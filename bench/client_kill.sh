#!/bin/bash
# Client-kill benchmark: does a client that dies mid-stream hold up the next
# request?  One CPU worker serves a deployment with max_batch 1, so a request
# nobody cancels would hold the only sequence slot until it ends.  Each trial
# starts a long request (400 tokens) with `tessera generate`, waits for its
# first tokens, kills the client with SIGKILL, and at once sends a one-token
# request and times its first token.  The same one-token request on the idle
# replica is the baseline.  Prints both TTFT distributions, the decode step
# time, and the difference at p50 against the target: the next request's
# first token is not delayed by more than one step (the cancel lands at the
# next step boundary).
#   bench/client_kill.sh     a few seconds on 2 cores
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
bench_setup bench/client_kill.sh "$BIN/tessera" "$BIN/tessera-coordinator" "$BIN/tessera-worker"
bench_small_model
WP=$(free_port) CP=$(free_port)
cat > "$T/d.yaml" <<YAML
version: 1
coordinator: {workers_endpoint: "tcp://127.0.0.1:$WP", control_endpoint: "tcp://127.0.0.1:$CP",
              security: none}
deployments:
  - name: m
    model: $PWD/$MODEL
    max_seq_len: 512
    max_batch: 1
YAML
bench_one_worker bench/client_kill.sh

echo "== Client-kill benchmark"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: $MODEL (hidden 256, 4 layers, f32), 1 worker, max_batch 1; 20 trials of each"
python3 - "$BIN/tessera" "tcp://127.0.0.1:$CP" <<'PY'
import os, signal, subprocess, sys, time

cli, ep = sys.argv[1], sys.argv[2]

def start(max_tokens, prompt):
    return subprocess.Popen([cli, "--coordinator", ep, "generate", "m", "--prompt-ids", prompt,
                             "--max-tokens", str(max_tokens), "--ids"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

def first_tokens(p, n):
    """Reads until n ids have arrived; returns the time of each."""
    times, buf = [], b""
    while len(times) < n:
        c = p.stdout.read(1)
        if not c:
            raise SystemExit("bench/client_kill.sh: a request ended early")
        if c in b" \n" and buf:
            times.append(time.monotonic())
            buf = b""
        elif c.isdigit():
            buf += c
    return times

def ttft():
    t0 = time.monotonic()
    p = start(1, "5,6,7")
    out, _ = p.communicate(timeout=60)
    t1 = time.monotonic()
    if p.returncode != 0 or not out.split():
        raise SystemExit("bench/client_kill.sh: the probe failed")
    return (t1 - t0) * 1e3   # to its one token (and the process exit)

def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]

ttft()   # warm up
base, after, steps = [], [], []
for i in range(20):
    base.append(ttft())
    long = start(400, "1,2,3,4")
    t = first_tokens(long, 6)
    steps.append((t[-1] - t[1]) / 4 * 1e3)   # decode steps between tokens 2 and 6
    long.send_signal(signal.SIGKILL)
    long.wait()
    after.append(ttft())
step = pct(steps, 0.5)
print("decode step: p50 %.2f ms" % step)
print("%-34s p50 %7.2f ms   p90 %7.2f ms" % ("one-token request, replica idle:", pct(base, .5), pct(base, .9)))
print("%-34s p50 %7.2f ms   p90 %7.2f ms" % ("right after a client is killed:", pct(after, .5), pct(after, .9)))
d = pct(after, .5) - pct(base, .5)
print("delay at p50: %+.2f ms (target: at most one decode step, %.2f ms): %s"
      % (d, step, "met" if d <= step else "MISSED"))
print("(without the cancel the request would wait for the killed one's ~%d remaining steps, ~%.0f ms)"
      % (394, 394 * step))
PY
