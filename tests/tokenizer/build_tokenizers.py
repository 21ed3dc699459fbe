"""Builds the tokenizers the agreement test compares against, with Hugging Face's
`tokenizers` library: two byte-level BPE ones (Llama 3 style, GPT-2 style) and two
SentencePiece-style BPE ones (legacy Prepend/Replace normalizers, and Metaspace).

    python build_tokenizers.py OUT_DIR     -> OUT_DIR/{llama3,gpt2,sp-legacy,sp-metaspace}/
    python build_tokenizers.py OUT_DIR sp  -> the two SentencePiece-style ones only
"""
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

import corpus

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def write(tok, out, name, config):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def byte_level(out, training):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training, trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials, show_progress=False))
    tok.add_tokens([AddedToken("<tool>", lstrip=True, rstrip=True, normalized=False),
                    AddedToken("magic", single_word=True)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    write(tok, out, "llama3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                               "chat_template": "{{ '<|start_header_id|>' }}"})

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training, trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False))
    write(tok, out, "gpt2", {"eos_token": "<|endoftext|>"})


def with_byte_tokens(tok):
    """Moves <unk>, <s>, </s> to ids 0-2 and puts <0x00>..<0xFF> at 3-258, as
    SentencePiece conversions do; merges name tokens by text, so they carry over."""
    doc = json.loads(tok.to_str())
    vocab = doc["model"]["vocab"]
    first = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    rest = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in first]
    doc["model"]["vocab"] = {t: i for i, t in enumerate(first + rest)}
    for a in doc["added_tokens"]:
        a["id"] = doc["model"]["vocab"][a["content"]]
    return Tokenizer.from_str(json.dumps(doc))


def sentencepiece(out, training):
    sp_decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    for name in ("sp-legacy", "sp-metaspace"):
        tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
        if name == "sp-legacy":
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
            tok.decoder = sp_decoder
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                         split=False)
            tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.train_from_iterator(training, trainers.BpeTrainer(
            vocab_size=2500, limit_alphabet=150, max_token_length=12,
            special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
        tok = with_byte_tokens(tok)
        tok.add_tokens([AddedToken("[INST]", special=True, normalized=False),
                        AddedToken("[/INST]", special=True, normalized=False, lstrip=True)])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        write(tok, out, name, {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                               "chat_template": "{{ bos_token }}[INST]"})


def main_into(out, which=("byte-level", "sp")):
    training = corpus.training_text()
    if "byte-level" in which:
        byte_level(out, training)
    if "sp" in which:
        sentencepiece(out, training)


if __name__ == "__main__":
    main_into(sys.argv[1], sys.argv[2:] or ("byte-level", "sp"))
