"""Real-text traces: stdlib files, tokenized, hashed step by step like whole sequences."""

from __future__ import annotations

import numpy as np

from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.planner.trace import serving_steps, stdlib_files, stdlib_token_sequences

CONFIG = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(300, 500))


class WordTokenizer:
    """A stand-in tokenizer: byte values of the text (the real one is tested in test_tokenizer)."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode_batch(self, texts, add_special_tokens=False):
        return [self._Enc(list(t.encode()[:200])) for t in texts]


def test_stdlib_files_exist():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files[:10])
    assert not any("site-packages" in f.parts for f in files)


def test_steps_equal_hashing_each_sequence_whole():
    seqs = stdlib_token_sequences(1500, tokenizer=WordTokenizer())
    assert sum(s.size for s in seqs) == 1500
    token_map = np.arange(256, dtype=np.int64)
    hasher = NgramHasher(CONFIG, token_map)
    for chunk in (1, 7):
        steps = list(serving_steps(CONFIG, token_map, seqs, batch=3, chunk=chunk))
        assert sum(s.size for s in steps) == 1500 * CONFIG.rows_per_token
        # the first step holds the first `chunk` tokens of the first 3 sequences
        want = [hasher.table_ids(hasher.hash_all(s[None, :chunk]))[0].numpy() for s in seqs[:3]]
        assert (steps[0] == np.concatenate(want)).all()
