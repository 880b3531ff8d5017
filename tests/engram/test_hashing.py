import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_offload.engram import hashing
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher

from reference import reference_row_ids

SMALL = EngramConfig(layer_ids=(1, 4), max_ngram_size=4, n_heads=3, head_dim=32,
                     prime_starts=(500, 700, 900), pad_id=3, variant="v4.1",
                     row_format="fp8_e4m3_ue8m0")
VOCAB = 50
TOKEN_MAP = np.array([i % 37 for i in range(VOCAB)], dtype=np.int64)  # 37 compressed ids


@pytest.fixture
def small_hasher() -> NgramHasher:
    return NgramHasher(SMALL, TOKEN_MAP)  # one per test: every test checks its construction


def test_demo_vectors(demo_vectors):
    meta = demo_vectors["meta"]
    config = EngramConfig.from_demo(**meta["config"])
    hasher = NgramHasher(config, demo_vectors["lookup_table"])
    assert hasher.compressed_vocab_size == meta["compressed_vocab_size"]
    assert hasher.pad == meta["compressed_pad_id"]
    out = hasher.hash(demo_vectors["input_ids"])
    for layer in config.layer_ids:
        local = out[layer] - torch.tensor(config.head_offsets(layer))
        assert torch.equal(local, demo_vectors[f"hash.layer{layer}"]), layer
        assert out[layer].dtype == torch.int64
        assert out[layer].shape == (*demo_vectors["input_ids"].shape, config.cols_per_layer)


def test_matches_reference_with_dead_tokens(small_hasher):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (3, 40))
    dead = rng.random((3, 40)) < 0.15
    got = small_hasher.hash_all(ids, dead).numpy()
    for b in range(3):
        assert np.array_equal(got[b], reference_row_ids(SMALL, TOKEN_MAP, ids[b].tolist(), dead[b].tolist()))


def test_large_batch_uses_threads_and_matches(small_hasher, monkeypatch):
    """A batch above the per-thread chunk equals the same tokens hashed in small steps, at every
    position (fresh ids each run, so no earlier result can stand in for this one)."""
    monkeypatch.setattr(hashing, "_POOL", None)  # the worker pool is made on first use
    seed = int(np.random.SeedSequence().entropy % 2**32)
    ids = np.random.default_rng(seed).integers(0, VOCAB, (3, 5000))
    got = small_hasher.hash_all(ids)
    history = small_hasher.new_history()
    steps = [small_hasher.hash_pieces(history, [0, 1, 2], list(ids[:, s:s + 1000])) for s in range(0, 5000, 1000)]
    want = torch.stack([torch.cat([step[b * 1000:(b + 1) * 1000] for step in steps]) for b in range(3)])
    assert torch.equal(got, want), f"seed {seed}"
    assert np.array_equal(got[1, -50:].numpy(), reference_row_ids(SMALL, TOKEN_MAP, ids[1].tolist())[-50:])


def test_negative_ids_pass_through_like_the_demo_when_asked():
    ids = [[5, -1, 7, 9]]
    got = NgramHasher(SMALL, TOKEN_MAP, negative_ids="pass").hash_all(ids).numpy()[0]
    assert np.array_equal(got, reference_row_ids(SMALL, TOKEN_MAP, ids[0]))
    assert (got >= 0).all()


def test_out_of_vocabulary_id_is_named(small_hasher):
    with pytest.raises(ValueError, match=r"^token id 50 is outside the vocabulary of 50 ids; "
                                         r"was the text tokenized with another tokenizer\?$"):
        small_hasher.hash([[1, 2, 50]])


def test_declared_compressed_vocab_must_match():
    with pytest.raises(ValueError, match=r"^the tokenizer compresses to 37 ids but the config declares engram_compressed_vocab_size 99,092: "
                       r"the table was hashed over another tokenizer; load the checkpoint's own tokenizer$"):
        NgramHasher(SMALL.replace(compressed_vocab_size=99_092), TOKEN_MAP)


def test_table_ids_add_layer_bases(small_hasher):
    rows = small_hasher.hash_all([[1, 2, 3]])
    flat = small_hasher.table_ids(rows)
    assert torch.equal(flat[..., 1, :] - rows[..., 1, :],
                       torch.full_like(rows[..., 1, :], SMALL.layer_row_base(4)))
    assert int(flat.max()) < SMALL.num_rows
    as_array = small_hasher.table_ids(rows.numpy())  # the same ids, as a NumPy array
    assert isinstance(as_array, np.ndarray) and np.array_equal(as_array, flat.numpy())


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_flat_ids_are_the_table_ids_of_the_row_ids(kernel):
    """``flat=True`` hashes straight into the table's flat row space: table_ids of the rows."""
    hasher, plain = NgramHasher(SMALL, TOKEN_MAP), NgramHasher(SMALL, TOKEN_MAP)
    if kernel == "numpy":
        hasher._kernel = plain._kernel = None
    elif hasher._kernel is None:
        pytest.skip("the native hash kernel is not built")
    flat_history, plain_history = hasher.new_history(), plain.new_history()
    pieces = [[1, 2, 3], [4, 5]]
    got = hasher.pieces_ids(flat_history, [0, 1], pieces, flat=True)
    assert np.array_equal(got, plain.table_ids(plain.pieces_ids(plain_history, [0, 1], pieces)))
    got = hasher.decode_ids(flat_history, [0, 1], np.array([6, 7]), flat=True)
    assert np.array_equal(got, plain.table_ids(plain.decode_ids(plain_history, [0, 1], np.array([6, 7]))))
    assert int(got[:, 1].min()) >= SMALL.layer_row_base(4)  # the second layer's rows, not the first's


def test_the_numpy_forms_hash_like_the_tensor_forms(small_hasher):
    tensor_history, array_history = small_hasher.new_history(), small_hasher.new_history()
    pieces = [[1, 2, 3], [4, 5]]
    want = small_hasher.hash_pieces(tensor_history, [0, 1], pieces)
    got = small_hasher.pieces_ids(array_history, [0, 1], pieces)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())
    want = small_hasher.hash_decode(tensor_history, [0, 1], [6, 7])
    got = small_hasher.decode_ids(array_history, [0, 1], np.array([6, 7]))
    assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
)
def test_any_split_equals_whole(small_hasher, data, lengths):
    """Hashing sequences piece by piece (chunked prefill, then decode) equals hashing them whole."""
    seqs = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)) for n in lengths]
    deads = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    use_dead = data.draw(st.booleans())
    history = small_hasher.new_history(capacity=1)  # forces growth
    got = [[] for _ in seqs]
    cursor = [0] * len(seqs)
    while any(c < len(s) for c, s in zip(cursor, seqs)):
        active = [i for i, s in enumerate(seqs) if cursor[i] < len(s)]
        pieces, dead_pieces = [], []
        decode = data.draw(st.booleans())
        for i in active:
            n = 1 if decode else data.draw(st.integers(1, len(seqs[i]) - cursor[i]))
            pieces.append(seqs[i][cursor[i]: cursor[i] + n])
            dead_pieces.append(deads[i][cursor[i]: cursor[i] + n] if use_dead else None)
            cursor[i] += n
        if decode and not use_dead:
            out = small_hasher.hash_decode(history, active, [p[0] for p in pieces])
        else:
            out = small_hasher.hash_pieces(history, active, pieces, dead_pieces)
        start = 0
        for i, piece in zip(active, pieces):
            got[i].append(out[start: start + len(piece)])
            start += len(piece)
        assert start == out.shape[0]
    for i, s in enumerate(seqs):
        whole = small_hasher.hash_all([s], [deads[i]] if use_dead else None)[0]
        assert torch.equal(torch.cat(got[i]), whole)


def test_released_sequence_starts_over(small_hasher):
    history = small_hasher.new_history()
    first = small_hasher.hash_pieces(history, [7], [[1, 2, 3]])
    small_hasher.hash_pieces(history, [7], [[4]])
    history.release(7)
    assert 7 not in history
    assert torch.equal(small_hasher.hash_pieces(history, [7], [[1, 2, 3]]), first)


def test_pieces_argument_errors(small_hasher):
    history = small_hasher.new_history()
    with pytest.raises(ValueError, match=r"^seq_ids, pieces \(and dead\) must have one entry per sequence$"):
        small_hasher.hash_pieces(history, [1, 2], [[1]])
    with pytest.raises(ValueError, match=r"^a sequence may appear only once per step$"):
        small_hasher.hash_pieces(history, [1, 1], [[1], [2]])
    with pytest.raises(ValueError, match="2 token ids for 3 sequences"):
        small_hasher.hash_decode(history, [1, 2, 3], [1, 2])


@pytest.mark.native
@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-5, VOCAB - 1), min_size=6, max_size=6), min_size=1, max_size=40))
def test_native_kernel_equals_numpy_path(rows):
    """The compiled kernel and the NumPy fallback give the same ids (negative ids included)."""
    native = NgramHasher(SMALL, TOKEN_MAP, negative_ids="pass")
    if native._kernel is None:
        pytest.skip("the native hash kernel is not built")
    fallback = NgramHasher(SMALL, TOKEN_MAP, negative_ids="pass")
    fallback._kernel = None
    ids = np.array(rows)
    assert torch.equal(native.hash_all(ids), fallback.hash_all(ids))


def test_native_kernel_extreme_mixes():
    """Mixes near 2**63 and large primes: the reciprocal modulo stays exact."""
    config = EngramConfig(layer_ids=(1,), max_ngram_size=2, n_heads=4, head_dim=32,
                          prime_starts=(2**31,), pad_id=0)
    token_map = np.arange(1000, dtype=np.int64)
    native = NgramHasher(config, token_map)
    fallback = NgramHasher(config, token_map)
    fallback._kernel = None
    native.multipliers[:] = (2**63 - 1) // 1000 | 1  # products close to 2**63
    fallback.multipliers[:] = native.multipliers
    ids = np.arange(1000).reshape(1, -1)
    assert torch.equal(native.hash_all(ids), fallback.hash_all(ids))


IMAGE = 49
WITH_IMAGES = SMALL.replace(image_token_id=IMAGE)


def test_image_tokens_are_dead_by_default_in_batches():
    hasher = NgramHasher(WITH_IMAGES, TOKEN_MAP)
    ids = np.array([[3, 4, IMAGE, IMAGE, 7, 8, 9, 10], [IMAGE, 1, 2, 3, 4, 5, 6, IMAGE]])
    got = hasher.hash_all(ids).numpy()
    for b in range(2):
        dead = (ids[b] == IMAGE).tolist()
        assert np.array_equal(got[b], reference_row_ids(WITH_IMAGES, TOKEN_MAP, ids[b].tolist(), dead))
    # an explicit mask is used as given: here, nothing is dead
    live = hasher.hash_all(ids, np.zeros(ids.shape, bool)).numpy()
    assert np.array_equal(live[0], reference_row_ids(WITH_IMAGES, TOKEN_MAP, ids[0].tolist()))
    assert not np.array_equal(live, got)
    # without an image token id in the config nothing is dead by default
    assert np.array_equal(NgramHasher(SMALL, TOKEN_MAP).hash_all(ids).numpy(), live)


def test_image_tokens_are_dead_by_default_in_pieces_and_decode_steps():
    hasher = NgramHasher(WITH_IMAGES, TOKEN_MAP)
    # the first image token arrives in a decode step, the others in a prefill piece
    seqs = {0: [5, 6, 7, 8, IMAGE, IMAGE, 9, 11, IMAGE, 13], 1: [1, 2, 3, 4, 5, 6, 7, 8, IMAGE, 9]}
    history = hasher.new_history()
    got = {s: [hasher.hash_pieces(history, [s], [seqs[s][:4]])] for s in seqs}  # prefill, dead=None
    for t in range(4, 10):  # then one token per sequence per step
        out = hasher.hash_decode(history, [0, 1], [seqs[0][t], seqs[1][t]])
        got[0].append(out[:1])
        got[1].append(out[1:])
    for s, ids in seqs.items():
        expected = reference_row_ids(WITH_IMAGES, TOKEN_MAP, ids, [t == IMAGE for t in ids])
        assert np.array_equal(torch.cat(got[s]).numpy(), expected), s
    # a piece with its own mask keeps it; a piece without one takes the default
    prefill = hasher.hash_pieces(hasher.new_history(), [0], [seqs[0][2:]])
    assert np.array_equal(prefill.numpy(), reference_row_ids(WITH_IMAGES, TOKEN_MAP, seqs[0][2:],
                                                             [t == IMAGE for t in seqs[0][2:]]))
    history = hasher.new_history()
    out = hasher.hash_pieces(history, [0, 1], [seqs[0], seqs[1]], dead=[np.zeros(10, bool), None])
    assert np.array_equal(out[:10].numpy(), reference_row_ids(WITH_IMAGES, TOKEN_MAP, seqs[0]))
    assert np.array_equal(out[10:].numpy(), reference_row_ids(WITH_IMAGES, TOKEN_MAP, seqs[1],
                                                              [t == IMAGE for t in seqs[1]]))
    with pytest.raises(ValueError, match="a dead mask of 3 entries for a piece of 10 tokens"):
        hasher.hash_pieces(hasher.new_history(), [0], [seqs[0]], dead=[[True, False, True]])


def test_decode_steps_return_to_the_fast_path_once_image_tokens_leave_the_window(monkeypatch):
    """A dead token slows only the steps whose n-grams still reach it (N-1 steps), not every
    later step of every sequence; the rows stay those of the whole sequences."""
    hasher = NgramHasher(WITH_IMAGES, TOKEN_MAP)
    history = hasher.new_history()
    seqs = {0: [5, 6, IMAGE], 1: [1, 2, 3]}
    got = {s: [hasher.hash_pieces(history, [s], [seqs[s]])] for s in seqs}
    slow_steps = []
    real = hasher.pieces_ids  # the general path (hash_pieces' NumPy form)
    monkeypatch.setattr(hasher, "pieces_ids", lambda *a, **k: slow_steps.append(1) or real(*a, **k))
    window = WITH_IMAGES.max_ngram_size - 1
    for t in range(window + 3):
        tokens = [10 + t, 20 + t]
        out = hasher.hash_decode(history, [0, 1], tokens)
        for s in seqs:
            seqs[s].append(tokens[s])
            got[s].append(out[s:s + 1])
    assert len(slow_steps) == window  # while the image is among the last N-1 tokens, then never
    for s, ids in seqs.items():
        expected = reference_row_ids(WITH_IMAGES, TOKEN_MAP, ids, [t == IMAGE for t in ids])
        assert np.array_equal(torch.cat(got[s]).numpy(), expected), s


def test_hash_applies_the_dead_mask_per_layer(small_hasher):
    ids = np.array([[4, 8, 15, 16, 23, 42]])
    dead = np.array([[False, False, True, False, False, False]])
    rows = small_hasher.hash_all(ids, dead)
    per_layer = small_hasher.hash(ids, dead)
    assert list(per_layer) == list(SMALL.layer_ids)
    for i, layer in enumerate(SMALL.layer_ids):
        assert torch.equal(per_layer[layer], rows[:, :, i])
    assert not torch.equal(per_layer[1], small_hasher.hash(ids)[1])


def test_masks_and_ids_as_tensors_or_columns(small_hasher):
    """Tensors hash like arrays; a decode step takes a ``[S, 1]`` column of tokens and a
    piece may be a ``[1, n]`` row (a tokenizer's output)."""
    ids = np.array([[4, 8, 15, 16, 23, 42]])
    dead = np.array([[False, True, False, False, True, False]])
    want = small_hasher.hash_all(ids, dead)
    assert torch.equal(small_hasher.hash_all(torch.from_numpy(ids), torch.from_numpy(dead)), want)
    pieces = small_hasher.hash_pieces(small_hasher.new_history(), [0], [torch.from_numpy(ids)],
                                      dead=[torch.from_numpy(dead)])
    assert torch.equal(pieces, want[0])
    history = small_hasher.new_history()
    first = small_hasher.hash_pieces(history, [0, 1], [ids[:, :3], ids[:, :2]])
    step = small_hasher.hash_decode(history, [0, 1], torch.tensor([[16], [15]]))
    assert torch.equal(first[:3], small_hasher.hash_all(ids[:, :3])[0])
    assert torch.equal(step, torch.stack([small_hasher.hash_all(ids[:, :4])[0, 3],
                                          small_hasher.hash_all(ids[:, :3])[0, 2]]))


def test_a_step_without_sequences_hashes_nothing(small_hasher):
    out = small_hasher.hash_pieces(small_hasher.new_history(), [], [])
    assert out.shape == (0, 2, SMALL.cols_per_layer) and out.dtype == torch.int64


def test_token_map_and_pad_id_are_checked():
    with pytest.raises(ValueError, match=r"^token_map must be a non-empty 1-D array of compressed ids$"):
        NgramHasher(SMALL, np.zeros(0, np.int64))
    with pytest.raises(ValueError, match=r"^token_map must be a non-empty 1-D array of compressed ids$"):
        NgramHasher(SMALL, TOKEN_MAP.reshape(5, 10))
    with pytest.raises(ValueError, match=r"^pad_id 3 is outside the vocabulary of 3$"):
        NgramHasher(SMALL, TOKEN_MAP[:3])
    one = NgramHasher(SMALL.replace(pad_id=0), np.array([0]))  # a vocabulary of one id
    assert one.vocab_size == 1 and one.hash_all([[0, 0]]).shape == (1, 2, 2, SMALL.cols_per_layer)


def test_sequence_slots_are_reused_after_release(small_hasher):
    """A server that starts and finishes many sequences keeps its history at the size of the
    sequences alive at once; releasing an unknown sequence does nothing."""
    history = small_hasher.new_history(capacity=2)
    want = small_hasher.hash_all([[5, 6, 7]])[0]
    for seq in range(40):
        assert torch.equal(small_hasher.hash_pieces(history, [seq, 1000], [[5, 6, 7], [1]])[:3], want)
        history.release(seq)
        history.release(1000)
        history.release(seq + 5000)
    assert len(history) == 0 and history.capacity == 2 and len(history.tokens) == 2


def test_compress_maps_ids_and_passes_negative_ones_through_when_asked():
    token_map = np.arange(60, dtype=np.int64)[::-1].copy()  # id i -> 59 - i: no id maps to itself
    hasher = NgramHasher(SMALL, token_map)
    assert hasher.compress([0, 1, 40, 59]).tolist() == [59, 58, 19, 0]
    demo = NgramHasher(SMALL, token_map, negative_ids="pass")
    assert demo.compress([[0, -1], [40, -7]]).tolist() == [[59, -1], [19, -7]]
    assert hasher.compress(np.zeros((2, 0), np.int64)).shape == (2, 0)
    assert hasher.hash_all(np.zeros((2, 0), np.int64)).shape == (2, 0, 2, SMALL.cols_per_layer)


def test_shape_and_dtype_errors_are_named(small_hasher):
    with pytest.raises(ValueError, match=r"^token ids must be integers, got dtype float64$"):
        small_hasher.hash_all(np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"^input_ids must be \[batch, tokens\], got shape \(3,\)$"):
        small_hasher.hash_all([1, 2, 3])
    with pytest.raises(ValueError, match=r"^dead_mask shape \(1, 2\) != input_ids shape \(1, 3\)$"):
        small_hasher.hash_all([[1, 2, 3]], np.zeros((1, 2), bool))


@pytest.mark.parametrize("call", ["hash_all", "hash", "hash_pieces", "compress"])
def test_negative_token_ids_are_refused(small_hasher, call):
    ids = [[5, -3, 7, 9]]
    with pytest.raises(ValueError, match=r"^token id -3 is negative: token ids run from 0 to 49; "):
        if call == "hash_pieces":
            small_hasher.hash_pieces(small_hasher.new_history(), [0], [ids[0]])
        else:
            getattr(small_hasher, call)(ids)
    with pytest.raises(ValueError, match="negative_ids must be 'refuse' or 'pass'"):
        NgramHasher(SMALL, TOKEN_MAP, negative_ids="keep")
