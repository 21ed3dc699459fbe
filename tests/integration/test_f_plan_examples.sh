# (f) `tessera plan` on the shipped examples prints the placement.
source "$(dirname "$0")/lib.sh"
for f in "$ROOT"/configs/*.yaml; do
    "$BIN/tessera" plan "$f" > "$T/plan.txt" 2>&1 || fail "plan $f failed: $(cat "$T/plan.txt")"
    grep -q "^deployment " "$T/plan.txt" || fail "no deployment in plan of $f"
    grep -q "per-device memory" "$T/plan.txt" || fail "no memory figure in plan of $f"
    if grep -q "(unplaced)" "$T/plan.txt"; then fail "unplaced pieces in $f"; fi
    echo "== $f"; cat "$T/plan.txt"
done
# The demo: 4 pieces on one node.
"$BIN/tessera" plan "$ROOT/configs/demo.yaml" | grep -cE "^  0 +[01] +[0-9]+-[0-9]+ +[01] +node0-cpu[0-3]" | grep -qx 4 || fail "demo plan rows"
# On a described cluster of 2 nodes x 4 GPUs, a tp=4 pp=2 layout keeps each
# TP group on one node and puts the two stages on different nodes.
write_yaml "$T/g.yaml" 4 2 1 big "$MODEL" cuda
"$BIN/tessera" plan "$T/g.yaml" --nodes 2 --per-node 4 > "$T/g.txt" || fail "plan g failed"
s0=$(awk '$1=="0" && $2=="0" {print $6}' "$T/g.txt" | sort -u)
s1=$(awk '$1=="0" && $2=="1" {print $6}' "$T/g.txt" | sort -u)
[ "$(echo "$s0" | wc -l)" = 1 ] && [ "$(echo "$s1" | wc -l)" = 1 ] || fail "a TP group spans nodes: $(cat "$T/g.txt")"
[ "$s0" != "$s1" ] || fail "both stages on $s0"
# NVLink domains of 2 GPUs: each tp=2 group's two ranks share a LINK.
write_yaml "$T/l.yaml" 2 2 2 nvl "$MODEL" cuda
"$BIN/tessera" plan "$T/l.yaml" --nodes 2 --per-node 4 --nvlink 2 > "$T/l.txt" || fail "plan l failed"
grep -q " LINK " "$T/l.txt" || fail "no LINK column: $(head -6 "$T/l.txt")"
links=$(awk '$1 ~ /^[0-9]+$/ && NF >= 8 {print $1"/"$2, $6"/"$7}' "$T/l.txt" | sort -u | awk '{print $1}' | uniq -d)
[ -z "$links" ] || fail "a TP group spans NVLink domains ($links): $(cat "$T/l.txt")"
[ "$(awk '$1 ~ /^[0-9]+$/ && NF >= 8' "$T/l.txt" | wc -l)" = 8 ] || fail "plan l rows: $(cat "$T/l.txt")"
"$BIN/tessera" plan "$T/l.yaml" --nvlink 0 2> /dev/null; [ $? = 2 ] || fail "--nvlink 0 accepted"
# Too small a cluster: a clear shortage and exit 3.
"$BIN/tessera" plan "$T/g.yaml" --nodes 1 --per-node 4 > "$T/s.txt"; rc=$?
[ "$rc" = 3 ] || fail "short plan exited $rc"
grep -q "needs 4 more cuda workers" "$T/s.txt" || fail "no shortage message: $(cat "$T/s.txt")"
# GPU memory: every cuda piece shows its weights, KV pool, reserve and total;
# with GPUs too small for them, nothing is placed and the numbers are given.
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" > "$T/c.txt" || fail "cluster plan failed"
grep -q "WEIGHTS  *KV  *RESERVE  *TOTAL" "$T/c.txt" || fail "no memory columns: $(head -5 "$T/c.txt")"
grep -q "replicas follow load: 4 to start, up to 6 (2 more piece(s) from the idle workers, beyond coordinator.reserve_spares 2)" "$T/c.txt" ||
    fail "the 8B's range is not shown: $(grep -A2 "deployment llama-8b" "$T/c.txt")"
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --gpu-memory 24 > "$T/m.txt"; rc=$?
[ "$rc" = 3 ] || fail "a plan on 24 GiB GPUs exited $rc"
grep -q "NOT PLACED: needs 16 more cuda workers: stage 1 needs 28.1 GiB per cuda worker; the largest, node0-cuda0, has 24.0 GiB" "$T/m.txt" ||
    fail "no memory refusal: $(grep NOT "$T/m.txt")"
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --gpu-memory 80 > /dev/null || fail "a plan on 80 GiB GPUs failed"
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --gpu-memory x 2> /dev/null; [ $? = 2 ] || fail "--gpu-memory x accepted"
# --explain: the ways to cut each deployment, the file's among them, and the rule's
# choice (the fewest devices that fit): the 70B model of the example misses one
# 80 GiB GPU by 85 GiB, and three stages are the fewest devices it fits on; on 24 GiB
# GPUs the file's tp 8 x pp 2 says by how much it misses.
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --explain > "$T/x.txt" || fail "plan --explain failed"
awk '/^deployment llama-70b/,/^deployment llama-8b/' "$T/x.txt" > "$T/x70.txt"
grep -qE "^ +1 +1 +1 +165.19 GiB +no: 85.19 GiB short" "$T/x70.txt" || fail "no tp 1 row: $(cat "$T/x70.txt")"
grep -qE "^ +\* +1 +3 +3 " "$T/x70.txt" || fail "tp 1 x pp 3 not marked: $(cat "$T/x70.txt")"
grep -q "the rule would choose: tp 1 x pp 3: the fewest devices a replica fits on (3)" "$T/x70.txt" ||
    fail "no choice: $(cat "$T/x70.txt")"
grep -q "the file's tp 8 x pp 2 fits: 28.10 GiB per device" "$T/x70.txt" || fail "own layout: $(cat "$T/x70.txt")"
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --explain --gpu-memory 24 > "$T/x24.txt"
grep -q "the file's tp 8 x pp 2 does not fit: it needs 28.10 GiB per device, 4.10 GiB more than the 24.00 GiB each has" "$T/x24.txt" ||
    fail "no miss: $(cat "$T/x24.txt")"
"$BIN/tessera" plan "$ROOT/configs/cluster.yaml" --explain --mem-gbs 0 2> /dev/null; [ $? = 2 ] || fail "--mem-gbs 0 accepted"
# parallel: auto: the 70B model on 40 GiB GPUs, two nodes of four, is cut tp 4 (a node's
# tensor group, faster than tp 2 x pp 2) and the eight GPUs hold two replicas.
printf 'version: 1\ndeployments:\n  - name: big\n    model: %s\n    device: cuda\n    parallel: auto\n' \
    "$ROOT/configs/models/llama-3.1-70b" > "$T/auto.yaml"
"$BIN/tessera" plan "$T/auto.yaml" --nodes 2 --per-node 4 --gpu-memory 40 > "$T/auto.txt" || fail "auto plan: $(cat "$T/auto.txt")"
grep -q "^deployment big: parallel auto: tp 4 x pp 1 x 2 replica(s) over 8 cuda device(s)" "$T/auto.txt" ||
    fail "auto choice: $(head -3 "$T/auto.txt")"
grep -q "^deployment big: cuda, tp 4 x pp 1 x 2 replica(s) = 8 piece(s)" "$T/auto.txt" || fail "auto plan rows: $(cat "$T/auto.txt")"
# A bad file names its line and column.
printf 'version: 1\ndeployments:\n  - name: x\n    model: m\n    parallel: {tensor: two}\n' > "$T/bad.yaml"
"$BIN/tessera" plan "$T/bad.yaml" 2> "$T/bad.txt"; rc=$?
[ "$rc" = 1 ] || fail "bad file exited $rc"
grep -q "bad.yaml:5:.*deployments\[0\].parallel.tensor" "$T/bad.txt" || fail "bad message: $(cat "$T/bad.txt")"
# The README's --explain excerpts of the examples are what the command prints: each line
# under a "$ tessera plan FILE --explain" line appears in that command's output.
awk '/^On the examples \(excerpts;/ {on = 1} on && /^```$/ {n++; if (n == 2) exit; next} on && n == 1' \
    "$ROOT/README.md" > "$T/readme_x.txt"
[ "$(grep -c '^\$ tessera plan' "$T/readme_x.txt")" = 2 ] || fail "README's --explain excerpts not found"
while IFS= read -r line; do
    case "$line" in
    '$ tessera plan '*)
        f=$(echo "$line" | awk '{print $4}')
        "$BIN/tessera" plan "$ROOT/$f" --explain > "$T/readme_out.txt" || fail "plan $f --explain" ;;
    *) grep -qxF -- "$line" "$T/readme_out.txt" || fail "README's line is not in $f's --explain: '$line'" ;;
    esac
done < "$T/readme_x.txt"
ok "plans printed; TP groups on one node and one NVLink domain; memory per GPU; shortage, memory refusal and errors reported; --explain lists the cuts, the file's and the rule's choice; parallel: auto chosen; the README's excerpts are the output"
