"""The reference side of bench/tokenize.sh: the same texts, the same tokenizer, the
`tokenizers` library on one thread (RAYON_NUM_THREADS=1, and encode, not
encode_batch), no special tokens; the figure is the median of the passes.  Also writes
the texts file for the C side when asked.

    python tokenize.py write TEXTS_FILE MEGABYTES
    python tokenize.py run MODEL_DIR TEXTS_FILE PASSES
"""
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "tokenizer"))


def write(path, mb):
    import corpus
    rng = random.Random(3)
    out, size = [], 0
    while size < mb * 1_000_000:
        t = corpus._sentence(rng, rng.randint(20, 200))  # texts of about 0.1-1.5 KB
        out.append(t)
        size += len(t.encode())
    with open(path, "wb") as f:
        f.write("\x1e".join(out).encode())


def run(model_dir, path, passes):
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    data = open(path, "rb").read()
    texts = data.decode().split("\x1e")
    times, tokens = [], 0
    for _ in range(passes):
        t0 = time.perf_counter()
        tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print("bytes=%d texts=%d tokens=%d passes=%d median_s=%.4f mb_per_s=%.2f first_pass_s=%.4f"
          % (len(data), len(texts), tokens, passes, med, len(data) / med / 1e6, times[0]))


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], float(sys.argv[3]))
    else:
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
