import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engram_offload.engram.tokenizer import (
    cached_token_map,
    compress_tokenizer,
    default_tokenizer_path,
    engram_normalizer,
)


def test_deepseek_tokenizer_compresses_to_99092(tmp_path):
    path = default_tokenizer_path()
    token_map = cached_token_map(path, cache_dir=tmp_path)
    assert token_map.shape == (129_280,) and token_map.dtype == np.int64
    assert int(token_map.max()) + 1 == 99_092
    assert token_map[0] == 0  # first-seen order
    # the cache returns the same map, and survives a damaged cache file
    assert np.array_equal(cached_token_map(path, cache_dir=tmp_path), token_map)
    for f in tmp_path.iterdir():
        f.write_bytes(b"garbage")
    assert np.array_equal(cached_token_map(path, cache_dir=tmp_path), token_map)


def test_deepseek_tokenizer_merges_case_and_space():
    tok = Tokenizer.from_file(str(default_tokenizer_path()))
    token_map = cached_token_map()
    the = [tok.token_to_id(t) for t in ("The", "the", "ĠThe", "Ġthe")]
    assert all(t is not None for t in the)
    # lowercase, then strip: "The", "the", " The" and " the" share one compressed id
    assert len({int(token_map[t]) for t in the}) == 1


def test_normalizer_rules():
    norm = engram_normalizer().normalize_str
    assert norm(" ") == " "  # a lone space survives the strip
    assert norm("  \t\n") == " "
    assert norm(" Héllo  World ") == "hello world"
    assert norm("ﬁ") == "fi"  # NFKC


def _byte_level_tokenizer() -> Tokenizer:
    vocab = {"a": 0, "A": 1, "Ġa": 2, "Ġ": 3, "Ã": 4, "©": 5, "Ã©": 6, "Ġ Ġ": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_tokenizer_object_and_partial_utf8_tokens(tmp_path):
    tok = _byte_level_tokenizer()
    token_map = compress_tokenizer(tok)
    # "a", "A" and " a" (stripped) share a key
    assert token_map[0] == token_map[1] == token_map[2]
    # "Ã" and "©" alone are partial UTF-8 bytes: keyed by their raw token strings, so distinct
    assert len({token_map[4], token_map[5], token_map[6]}) == 3
    # a lone-space token keeps its own key " "
    assert token_map[3] != token_map[0]
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert np.array_equal(compress_tokenizer(path), token_map)
    assert np.array_equal(compress_tokenizer(tmp_path), token_map)


def test_transformers_tokenizer_if_installed():
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_byte_level_tokenizer())
    assert np.array_equal(compress_tokenizer(fast), compress_tokenizer(_byte_level_tokenizer()))


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        compress_tokenizer(tmp_path / "missing.json")
