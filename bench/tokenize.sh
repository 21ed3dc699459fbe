#!/bin/bash
# Tokenizer benchmark: encodes 1 MB of mixed text (ASCII, accents, CJK, emoji,
# whitespace runs, digits, special tokens; texts of 0.1-1.5 KB, like prompts) on one
# thread with Tessera's C tokenizer (build/bench/tokenize) and with the reference
# `tokenizers` library (RAYON_NUM_THREADS=1), for the four tokenizers the agreement
# test builds (tests/tokenizer/build_tokenizers.py), and prints MB/s for both and
# their ratio.  Both sides keep a word cache; the figure is the median of 5 passes,
# and the first (cold) pass is printed too.  Checks that both count the same tokens.
#   bench/tokenize.sh          about 1 minute on 2 cores
# Needs build/pyenv (scripts/pyenv.sh) and build/bench/tokenize (make bench).
set -u
cd "$(dirname "$0")/.."
BUILD="${TSR_BUILD:-build}"
PY=build/pyenv/bin/python
for f in "$PY" "$BUILD/bench/tokenize"; do
    [ -x "$f" ] || { echo "bench/tokenize.sh: $f is missing (make bench builds it)" >&2; exit 1; }
done
T=$(mktemp -d /tmp/tsr-tokbench.XXXXXX)
trap 'rm -rf "$T"' EXIT
(cd tests/tokenizer && "../../$PY" build_tokenizers.py "$T/tok") || exit 1
"$PY" bench/tokenize.py write "$T/texts" 1 || exit 1
echo "tokenizer benchmark: $(stat -c %s "$T/texts") bytes of mixed text, one thread, $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
printf '%-13s %10s %14s %14s %8s\n' tokenizer tokens "tessera MB/s" "reference MB/s" ratio
rc=0
for name in llama3 gpt2 sp-legacy sp-metaspace; do
    c=$(taskset -c 0 "$BUILD/bench/tokenize" "$T/tok/$name" "$T/texts" 5) || exit 1
    r=$(RAYON_NUM_THREADS=1 taskset -c 0 "$PY" bench/tokenize.py run "$T/tok/$name" "$T/texts" 5) || exit 1
    get() { echo "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
    if [ "$(get "$c" tokens)" != "$(get "$r" tokens)" ]; then
        echo "$name: token counts differ: tessera $(get "$c" tokens), reference $(get "$r" tokens)"
        rc=1
    fi
    printf '%-13s %10s %14s %14s %7.2fx\n' "$name" "$(get "$c" tokens)" "$(get "$c" mb_per_s)" \
        "$(get "$r" mb_per_s)" "$(awk -v a="$(get "$c" mb_per_s)" -v b="$(get "$r" mb_per_s)" 'BEGIN{print a/b}')"
    echo "    cold first pass: tessera $(get "$c" first_pass_s) s, reference $(get "$r" first_pass_s) s"
done
exit $rc
