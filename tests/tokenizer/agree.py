"""Checks Tessera's C tokenizer against Hugging Face's `tokenizers` on the corpus of
corpus.test_strings() and on random id sequences, for every tokenizer that
build_tokenizers.py makes.

    python agree.py TESSERA_BIN WORK_DIR

For each tokenizer and string: the ids (with and without the special tokens the
tokenizer adds), the decoded text (with and without special tokens), and the streaming
decoder's pieces, which must concatenate to the decoded text.  Then random ids after each
string's ids, as a completion after its prompt: the text they add to the prompt's (the
decode of both less the prompt's decode), whole and streamed.  Prints one line per
tokenizer and exits non-zero on any difference."""
import json
import os
import random
import subprocess
import sys

from tokenizers import Tokenizer

import build_tokenizers
import corpus


def run_c(tessera, model_dir, requests):
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    p = subprocess.run([tessera, "tokenize", model_dir, "--jsonl"], input=lines.encode(),
                       capture_output=True, check=False, timeout=600)
    if p.returncode != 0:
        sys.exit("tessera tokenize --jsonl failed: %s" % p.stderr.decode(errors="replace"))
    out = [json.loads(l) for l in p.stdout.decode().split("\n") if l]
    if len(out) != len(requests):
        sys.exit("expected %d answers, got %d" % (len(requests), len(out)))
    return out


def check(tessera, model_dir, strings, rng):
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    bad = []

    def differ(what, text, want, got):
        bad.append("%s for %r: tokenizers %r, tessera %r" % (what, text[:80], want, got))

    enc_req = [{"text": s, "special": sp} for s in strings for sp in (True, False)]
    enc = run_c(tessera, model_dir, enc_req)
    dec_req, dec_want, texts = [], [], []
    for r, got in zip(enc_req, enc):
        want = hf.encode(r["text"], add_special_tokens=r["special"]).ids
        if got.get("ids") != want:
            differ("ids (special=%s)" % r["special"], r["text"], want, got)
            continue
        for skip in (True, False):
            dec_req.append({"ids": want, "skip_special": skip})
            dec_want.append(hf.decode(want, skip_special_tokens=skip))
            texts.append(r["text"])
    vocab = hf.get_vocab_size(with_added_tokens=True)
    for _ in range(400):  # what a random model generates
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            dec_req.append({"ids": ids, "skip_special": skip})
            dec_want.append(hf.decode(ids, skip_special_tokens=skip))
            texts.append("random ids %s" % ids[:8])
    # A random completion after a prompt: what it adds to the prompt's text.  Where the
    # two do not concatenate (the prompt's last byte-fallback run going on into an invalid
    # one) there is no such text: left out.
    for r, got in zip(enc_req, enc):
        if not r["special"] or "ids" not in got:
            continue
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        head = hf.decode(got["ids"], skip_special_tokens=True)
        whole = hf.decode(got["ids"] + ids, skip_special_tokens=True)
        if whole.startswith(head) and not head.endswith("\ufffd"):
            dec_req.append({"ids": ids, "after": got["ids"], "skip_special": True})
            dec_want.append(whole[len(head):])
            texts.append("random ids %s after %r" % (ids[:8], r["text"][:40]))
    dec = run_c(tessera, model_dir, dec_req)
    n_after = sum("after" in r for r in dec_req)
    round_trips = 0
    for r, want, got, text in zip(dec_req, dec_want, dec, texts):
        if got.get("text") != want:
            differ("decode (skip_special=%s%s)" % (r["skip_special"], ", after a prompt"
                                                  if "after" in r else ""), text, want, got)
        elif "".join(got["stream"]) != got["text"]:
            differ("streamed pieces", text, got["text"], got["stream"])
        elif any("\ufffd" in p and "\ufffd" not in got["text"] for p in got["stream"]):
            differ("a broken character in a piece", text, got["text"], got["stream"])
        elif got["text"] == text:
            round_trips += 1
    return bad, len(enc_req), len(dec_req), round_trips, n_after


def main():
    tessera, work = sys.argv[1], sys.argv[2]
    build_tokenizers.main_into(work)
    strings = corpus.test_strings()
    rng = random.Random(5)
    failed = 0
    for name in ("llama3", "gpt2", "sp-legacy", "sp-metaspace"):
        bad, n_enc, n_dec, rt, n_after = check(tessera, os.path.join(work, name), strings, rng)
        print("%-13s %d strings: %d encodings, %d decodings (%d give back the input text, %d "
              "after a prompt), %d differences" % (name, len(strings), n_enc, n_dec, rt, n_after,
                                                   len(bad)))
        for b in bad[:8]:
            print("    " + b)
        failed += len(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
