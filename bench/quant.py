#!/usr/bin/python3
"""quant.py: what int8 weights (weights_dtype int8) do to a model's numbers,
on the NumPy reference (tests/reference/llama_ref.py; the CPU engine's
logits are within f32 noise of it, test_engine_cpu): for PROMPTS random
prompts of 16 ids, the unquantized model's 24 greedy tokens, then both
models' logits over prompt + those tokens (teacher-forced), and per
position whether their greedy picks agree, the mean absolute logit error,
and that over the mean absolute logit.

    python3 bench/quant.py MODEL_DIR [--prompts N]

A random model (tessera model-init) has no preferred tokens: its top two
logits are often close, so agreement there is a floor, not an estimate
for a trained model."""
import argparse
import os
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the machine
    if os.path.exists("/usr/bin/python3") and \
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import llama_ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--prompts", type=int, default=8)
    a = ap.parse_args()
    base = llama_ref.load_model(a.model_dir)
    quant = llama_ref.round_matmuls(llama_ref.load_model(a.model_dir), llama_ref.round_int8,
                                    llama_ref.round_int8_blocks)
    V = base["config"]["vocab_size"]
    rng = np.random.default_rng(7)
    agree = total = 0
    err = mag = 0.0
    margins = []
    for _ in range(a.prompts):
        prompt = [int(t) for t in rng.integers(3, V, 16)]
        ids = prompt + llama_ref.generate(base, prompt, 24)
        lb, lq = llama_ref.forward(base, ids)[15:], llama_ref.forward(quant, ids)[15:]
        agree += int(np.sum(lb.argmax(-1) == lq.argmax(-1)))
        total += lb.shape[0]
        err += float(np.abs(lb - lq).mean())
        mag += float(np.abs(lb).mean())
        top2 = np.sort(lb, axis=-1)[:, -2:]
        margins.extend((top2[:, 1] - top2[:, 0]).tolist())
    print(f"int8 weights against unquantized, {a.prompts} prompts of 16 ids, {total} positions "
          f"(teacher-forced on the unquantized greedy path): greedy picks agree at "
          f"{100.0 * agree / total:.1f} %; mean |logit error| {err / a.prompts:.4f} "
          f"({100.0 * err / mag:.2f} % of the mean |logit|); median top-2 margin "
          f"{float(np.median(margins)):.4f}")


if __name__ == "__main__":
    main()
