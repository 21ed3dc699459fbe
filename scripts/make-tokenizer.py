"""Makes configs/tokenizer/, the small tokenizer that `tessera model-init` writes beside
its random weights: a byte-level BPE of 1,024 ids in the Llama 3 style (the same split
pattern and ByteLevel steps), trained with Hugging Face's `tokenizers` library on this
repository's own README, so `make demo` prints text.  Ids 0-4 are special, and agree
with the config.json model-init writes (bos 1, eos 2).

    build/pyenv/bin/python scripts/make-tokenizer.py      (scripts/pyenv.sh makes build/pyenv)
"""
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "configs", "tokenizer")
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|pad|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>"]
# A chat template in the Llama 3 layout (header ids around the role, eot after each
# message), written for Tessera; the HTTP server recognises the layout by its markers.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")


def main():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = [l for l in text.splitlines() if l.strip()]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS, show_progress=False))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    assert tok.get_vocab_size() == 1024 and bos == 1 and tok.token_to_id("<|eot_id|>") == 2
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
        f.write("\n")
    print("wrote %s: %d ids" % (OUT, tok.get_vocab_size()))


if __name__ == "__main__":
    main()
