"""Deterministic text for training the test tokenizers and for checking agreement:
ASCII, accents, CJK, emoji, runs of spaces and newlines, digits, special tokens inside
text, and strings that look like invalid bytes."""
import random

WORDS = ("the quick brown fox jumps over lazy dog model shard worker coordinator token "
         "pipeline tensor stage replica deploy YAML config health status generate prompt "
         "batch stream cache memory GPU NCCL cluster failover restart latency throughput "
         "I'll we've they're it's can't don't HELLO World Python C++ int main() return 0;").split()
ACCENTS = "café naïve Ångström façade jalapeño über Straße São Paulo Ελληνικά русский язык " \
          "čeština Łódź Đà Nẵng İstanbul ﬁnance".split()
CJK = ["日本語のテキスト", "中文分词测试", "한국어 문장", "漢字かなカナ", "東京タワー", "你好，世界！"]
EMOJI = ["👍", "👍🏽", "👨‍👩‍👧", "🇫🇷", "🙂", "🚀✨", "❤️", "🧪🔬"]
DIGITS = ["0", "42", "1234567890", "3.14159", "1,000,000", "2026-12-01", "0x1F", "99%"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2003"]
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<|endoftext|>", "<tool>", "magic"]
ODD = ["<0xFF>", "<0x0A>", "\ufffd", "\x00", "\x01", "\x7f", "\u200b", "\u0085", "\ufeff",
       "e\u0301", "\u0301", "\U0010ffff", "\ud7ff", "\ue000", "\\xff\\xfe", "ÿþ", "Ã©", "â€™"]


def _piece(rng):
    r = rng.random()
    if r < 0.35:
        return rng.choice(WORDS)
    if r < 0.48:
        return rng.choice(ACCENTS)
    if r < 0.56:
        return rng.choice(CJK)
    if r < 0.62:
        return rng.choice(EMOJI)
    if r < 0.70:
        return rng.choice(DIGITS)
    if r < 0.80:
        return rng.choice(SPACES)
    if r < 0.88:
        return rng.choice(SPECIALS)
    if r < 0.94:
        return rng.choice(ODD)
    return "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 6)))


def _sentence(rng, n):
    out = []
    for _ in range(n):
        out.append(_piece(rng))
        r = rng.random()
        out.append(" " if r < 0.6 else "" if r < 0.8 else rng.choice(SPACES))
    return "".join(out)


def training_text():
    rng = random.Random(7)
    return [_sentence(rng, rng.randint(3, 30)) for _ in range(3000)]


def test_strings(count=2400):
    rng = random.Random(11)
    fixed = ["", " ", "  ", "\n", "a", "Hello world", " Hello", "Hello ", "  leading",
             "trailing  ", "a\n\nb", "x" * 300, " " * 40, "\n" * 20, "1234567890" * 5,
             "<|eot_id|><|eot_id|>", "<s></s>", "text<|eot_id|>text", "a <tool> b",
             "a  <tool>  b", "magic", "a magic b", "amagicb", " [/INST]", "x [/INST]y",
             "👨‍👩‍👧👨‍👩‍👧", "日本語" * 20] + SPECIALS + ODD + SPACES + EMOJI + CJK
    out = list(fixed)
    while len(out) < count:
        out.append(_sentence(rng, rng.randint(1, 25)))
    return out
