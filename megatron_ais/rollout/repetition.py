"""Repetitive responses: QaRL (arXiv 2604.07853) names the repetitive, garbled tokens that quantized rollouts produce
in long responses "error tokens". Its detection rule is not in the text we can read (the stored copy gives its
abstract only), so this counts the repetitive kind by a rule of our own: a response in which some n-gram of up to
`MAX_NGRAM` tokens occurs `MIN_REPEATS` times back to back (QaRL's example, "to to to to to to", is a 1-gram six
times)."""
from __future__ import annotations

MAX_NGRAM = 4
MIN_REPEATS = 4


def repeats_an_ngram(token_ids: list[int], max_ngram: int = MAX_NGRAM, min_repeats: int = MIN_REPEATS) -> bool:
    """Whether some n-gram (n ≤ `max_ngram`) occurs `min_repeats` times in a row in `token_ids`."""
    for n in range(1, max_ngram + 1):
        span = n * min_repeats
        run = 0  # positions i (so far, in a row) where token i equals token i + n
        for i in range(len(token_ids) - n):
            run = run + 1 if token_ids[i] == token_ids[i + n] else 0
            if run >= span - n:  # tokens [i - span + n + 1, i + n] are one n-gram, min_repeats times
                return True
    return False
