"""The faster language-mixing share (issue #35, cost target) gives exactly the values of the function it replaced,
so ``prorl-journal regrade`` of a result recorded before reproduces its components byte for byte; and both read the
whole turn (red team R3: reading only its first 16,384 characters let 16,400 ASCII letters of padding hide any
mixing).

Fast tier: pure functions. The oracle is the implementation before the change (commit 5d1ccf7), kept here
verbatim; the strings are random mixes of ASCII, Latin-1, Cyrillic, Greek, Arabic, Hebrew, Devanagari, Han, kana,
Hangul, fullwidth and halfwidth forms, combining marks, astral letters and emoji, lone surrogates, unassigned and
private-use code points, with few and many distinct characters, short and long (past the 16,384 characters the
share once read).
"""
from __future__ import annotations

import collections
import random
import unicodedata

from prorl_server.rewards import generated_texts, mixing_share
from prorl_server.types import Trajectory

_OLD_COUNT_DISTINCT = 256
_OLD_SCRIPT_GROUP = {"CJK": "CJK", "HIRAGANA": "CJK", "KATAKANA": "CJK", "BOPOMOFO": "CJK", "IDEOGRAPHIC": "CJK",
                     "HALFWIDTH": "CJK", "FULLWIDTH": "LATIN"}


def old_mixing_share(text: str) -> float:
    """prorl_server.rewards.mixing_share as of commit 5d1ccf7 (the oracle), reading the whole text as the share now
    does (it then cut the text to its first 16,384 characters)."""
    if text.isascii():
        return 0.0
    distinct = set(text)
    if len(distinct) <= _OLD_COUNT_DISTINCT:
        letters = ((ch, text.count(ch)) for ch in distinct if ch.isalpha())
    else:
        letters = ((ch, k) for ch, k in collections.Counter(text).items() if ch.isalpha())
    counts: dict[str, int] = {}
    for ch, k in letters:
        if ch < "\x80":
            group = "LATIN"
        else:
            word = unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]
            group = _OLD_SCRIPT_GROUP.get(word, word)
        counts[group] = counts.get(group, 0) + k
    total = sum(counts.values())
    return 0.0 if total == 0 else 1.0 - max(counts.values()) / total


_RANGES = [(0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
           (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF), (0x3100, 0x312F), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0xD800, 0xDFFF), (0xE000, 0xE0FF), (0xFF01, 0xFFEE), (0x1D400, 0x1D7FF),
           (0x1F600, 0x1F64F), (0x20000, 0x2A6DF), (0xE0000, 0xE01EF), (0x10FF00, 0x10FFFF), (0x0378, 0x0379)]


def _text(rng: random.Random) -> str:
    ranges = rng.sample(_RANGES, rng.randint(1, 5))
    # a few distinct characters (a language's alphabet) or many (up to thousands: the Counter path)
    alphabet = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.choice([1, 3, 10, 60, 70, 300, 3000]))]
    n = rng.choice([0, 1, 5, 50, 850, 4000])
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_the_faster_mixing_share_equals_the_old_one_on_random_mixed_strings():
    rng = random.Random(35)
    texts = [_text(rng) for _ in range(3000)]
    texts += ["Привет world, 你好 " * 50, "e\u0301te\u0301 café ÉTÉ", "\ud835\udc00\ud835\udc01 AB",  # a surrogate pair
              "\U0001D400\U0001D401 ab", "ｆｕｌｌ ｗｉｄｔｈ ﾊﾝｶｸ 漢字", "", "plain ascii only"]
    texts += ["".join(chr(c) for c in random.Random(0).sample(range(0x4E00, 0xA000), 16384)) + "Latin tail",
              "Ωmega " * 5000, "".join(chr(c) for c in range(0x20, 0x3000))]  # past the bound, many distinct
    # many distinct letters over several of the share's Counter chunks (16,384 characters each), a partial last one
    texts += ["".join(random.Random(1).choices([chr(c) for c in [*range(0x4E00, 0xA000), *range(0x400, 0x4FF)]],
                                               k=40000)) + "Latin tail"]
    differ = [t[:40] for t in texts if repr(mixing_share(t)) != repr(old_mixing_share(t))]
    assert not differ, differ[:5]
    assert sum(old_mixing_share(t) > 0 for t in texts) > 800  # most draws do mix scripts


def test_padding_a_turn_with_ascii_letters_does_not_hide_its_mixing():
    assert mixing_share("a" * 16400 + "Привет мир") == 1.0 - 16400 / 16409  # 9 Cyrillic letters after the padding
    assert mixing_share("Привет мир " + "a" * 16400) == 1.0 - 16400 / 16409


def test_generated_texts_decode_the_whole_turn(tokenizer):
    ids = tokenizer.encode("Привет мир " * 900, add_special_tokens=False)
    assert len(ids) > 4096  # past the 4,096 tokens a turn's decoding was cut to
    traj = Trajectory(prompt_ids=[1], response_ids=ids, response_logprobs=[0.0] * len(ids), loss_mask=[1] * len(ids),
                      num_turns=1)
    assert generated_texts([traj], tokenizer) == [tokenizer.decode(ids, skip_special_tokens=True)]
