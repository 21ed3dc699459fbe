# The C tokenizer against the reference `tokenizers` library: four tokenizers (two
# byte-level BPE, two SentencePiece-style BPE) built by tests/tokenizer/build_tokenizers.py,
# 2,400 strings each (ASCII, accents, CJK, emoji, whitespace runs, digits, special
# tokens inside text, invalid-looking bytes) and 400 random id sequences: the same ids,
# the same decoded text, and streamed pieces that concatenate to it; and random ids after
# each string's, as a completion after its prompt: the text they add to the prompt's.
source "$(dirname "$0")/lib.sh"
PY="$ROOT/build/pyenv/bin/python"
[ -x "$PY" ] || fail "no $PY: run scripts/pyenv.sh (make test does)"
(cd "$ROOT/tests/tokenizer" && "$PY" agree.py "$BIN/tessera" "$T/tok") || fail "the tokenizers differ"
ok "ids and text agree with the reference tokenizer"
