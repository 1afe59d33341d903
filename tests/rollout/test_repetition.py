"""A response repeats an n-gram back to back (`rollout/repetition.py`, our stand-in for QaRL's error tokens): the
scan agrees with a brute-force search on random token sequences over small alphabets, where repeats are common."""
import random

from megatron_ais.rollout.repetition import MAX_NGRAM, MIN_REPEATS, repeats_an_ngram


def _brute_force(tokens: list[int]) -> bool:
    return any(all(tokens[i + k * n:i + (k + 1) * n] == tokens[i:i + n] for k in range(MIN_REPEATS))
               for n in range(1, MAX_NGRAM + 1) for i in range(len(tokens) - n * MIN_REPEATS + 1))


def test_the_scan_agrees_with_a_brute_force_search():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        alphabet = rng.randint(1, 4)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 24))]
        expected = _brute_force(tokens)
        assert repeats_an_ngram(tokens) == expected, tokens
        found += expected
    assert 500 < found < 2500  # both answers are exercised


def test_examples():
    assert repeats_an_ngram([3, 9, 9, 9, 9, 9, 9])  # QaRL's "to to to to to to"
    assert repeats_an_ngram([1, 2, 1, 2, 1, 2, 1, 2])
    assert not repeats_an_ngram([1, 2, 1, 2, 1, 2, 1])  # a 2-gram three and a half times
    assert not repeats_an_ngram(list(range(5)) * 4)  # a 5-gram is longer than MAX_NGRAM
    assert not repeats_an_ngram([])
