"""``NgramHasher``: token ids -> Engram row ids (SPEC section 3), whole sequences or in pieces.

For position ``p`` and lookback ``k`` let ``c_k`` be the compressed id of token ``p-k``
(the compressed pad id before the sequence start, or from a "dead" token on: by default
the config's ``image_token_id``, or a caller's own mask). Per layer,
``mix_n = XOR_{k<n} c_k * m_k`` for orders ``n = 2..N``, and head ``h`` of order ``n``
reads row ``mix_n mod prime[n][h] + offset[n][h]`` of the layer (a "global" id in the
layer; the table's flat id adds ``config.layer_row_base(layer)``).

Internally positions run along the last axis (``[L, orders, heads, P]``) so every head's
modulo is one contiguous vector operation; large batches are split across threads
(NumPy releases the GIL in its loops). Results are returned as views ``[..., L, C]``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence, overload

import numpy as np
import torch

from .._native import native_disabled
from .config import EngramConfig

__all__ = ["NgramHasher", "SequenceHistory", "native_kernel"]


def native_kernel():
    """The compiled hash kernel, or None (not built, or switched off: ``_native.native_disabled``)."""
    if native_disabled():
        return None
    try:
        from . import _hashkernel
    except ImportError:
        return None
    return _hashkernel

# Positions per work item when a batch is split across threads; keeps the temporaries
# of one item ([L, orders, heads, chunk] int64) inside the CPU caches.
_CHUNK = 4096
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="engram-hash")
    return _POOL


def _as_numpy_ids(x: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _as_numpy_mask(x: np.ndarray | torch.Tensor | Sequence[bool]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(bool, copy=False)


class NgramHasher:
    """Hashes token ids into the row ids of every Engram layer of ``config``.

    ``token_map`` is the compression map (``compress_tokenizer``): int64 ``[V]`` raw id ->
    compressed id. A negative id is refused (no tokenizer makes one; it would hash to rows
    no text reads); ``negative_ids="pass"`` passes them through uncompressed, as DeepSeek's
    demo does (SPEC section 1), for comparing with it.

    Dead tokens: wherever a caller passes no mask, tokens equal to ``config.image_token_id``
    are dead (``dead_mask``); a mask the caller passes is used as given.
    """

    def __init__(self, config: EngramConfig, token_map: np.ndarray | torch.Tensor | Sequence[int], *,
                 negative_ids: str = "refuse"):
        if negative_ids not in ("refuse", "pass"):
            raise ValueError(f"negative_ids must be 'refuse' or 'pass', got {negative_ids!r}")
        self.pass_negative_ids = negative_ids == "pass"
        self.config = config
        self.token_map = _as_numpy_ids(token_map)
        if self.token_map.ndim != 1 or self.token_map.size == 0:
            raise ValueError("token_map must be a non-empty 1-D array of compressed ids")
        self.vocab_size = int(self.token_map.size)
        self.compressed_vocab_size = int(self.token_map.max()) + 1
        declared = config.compressed_vocab_size
        if declared is not None and declared != self.compressed_vocab_size:
            raise ValueError(
                f"the tokenizer compresses to {self.compressed_vocab_size:,} ids but the config "
                f"declares engram_compressed_vocab_size {declared:,}: the table was hashed over "
                "another tokenizer; load the checkpoint's own tokenizer"
            )
        if not 0 <= config.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {config.pad_id} is outside the vocabulary of {self.vocab_size}")
        self.pad = int(self.token_map[config.pad_id])
        n, orders, heads = config.max_ngram_size, config.num_orders, config.n_heads
        layers = config.layer_ids
        # [L, N] multipliers; [L, orders, heads] primes; [L, C] head offsets; [L] layer bases
        self.multipliers = np.stack([config.multipliers(i, self.compressed_vocab_size) for i in layers])
        self.primes = np.array([config.primes[i] for i in layers], dtype=np.int64).reshape(len(layers), orders, heads)
        self.offsets = np.array([config.head_offsets(i) for i in layers], dtype=np.int64)
        self.layer_bases = np.array(config.layer_row_bases, dtype=np.int64)
        self._col_shift = self.offsets.reshape(len(layers), orders, heads, 1)
        # the same shifts plus each layer's first row: hashing straight into the flat row space
        self._flat_offsets = self.offsets + self.layer_bases[:, None]  # [L, C]
        self._flat_shift = self._flat_offsets.reshape(len(layers), orders, heads, 1)
        self._max_n = n
        # floor(2**64 / prime), for the native kernel's reciprocal modulo
        self._magic = np.array([(1 << 64) // int(p) for p in self.primes.reshape(-1)],
                               dtype=np.uint64).reshape(self.primes.shape)
        self._kernel = native_kernel()
        self.image_token_id = config.image_token_id

    def dead_mask(self, input_ids: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray | None:
        """The default dead mask of raw ids (same shape): tokens equal to the config's
        ``image_token_id``; None when the config has none or no token is dead."""
        if self.image_token_id is None:
            return None
        dead = _as_numpy_ids(input_ids) == self.image_token_id
        return dead if dead.any() else None

    # ------------------------------------------------------------------ compression
    def compress(self, input_ids: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray:
        """Raw ids -> compressed ids (same shape); a negative id is refused (``ValueError``), or
        passed through unchanged with ``negative_ids="pass"``."""
        ids = _as_numpy_ids(input_ids)
        if ids.size and ids.max() >= self.vocab_size:
            bad = int(ids[ids >= self.vocab_size].flat[0])
            raise ValueError(
                f"token id {bad} is outside the vocabulary of {self.vocab_size} ids; "
                "was the text tokenized with another tokenizer?"
            )
        if ids.size and ids.min() < 0:
            if not self.pass_negative_ids:
                raise ValueError(
                    f"token id {int(ids.min())} is negative: token ids run from 0 to {self.vocab_size - 1}; "
                    "drop padding or placeholder ids (or mark those positions dead) before hashing"
                )
            return np.where(ids >= 0, self.token_map[np.maximum(ids, 0)], ids)
        return self.token_map[ids]

    # ------------------------------------------------------------------ core
    def _hash_windows_into(self, windows: np.ndarray, out: np.ndarray, flat: bool = False) -> None:
        """windows int64 [P, N] (column k = compressed id at lookback k) -> out [L, orders, heads, P]
        (``flat``: ids in the table's flat row space, see ``table_ids``)."""
        if self._kernel is not None:
            layers, orders, heads = self.primes.shape
            self._kernel.hash_windows(np.ascontiguousarray(windows), self.multipliers, self.primes, self._magic,
                                      self._flat_offsets if flat else self.offsets, out, windows.shape[0],
                                      self._max_n, layers, heads)
            return
        products = self.multipliers[:, :, None] * windows.T[None]  # [L, N, P]
        rolling = products[:, 0].copy()  # [L, P]
        for k in range(1, self._max_n):
            np.bitwise_xor(rolling, products[:, k], out=rolling)
            # rolling is mix_{k+1}; every head of order k+1 reduces it by its prime
            np.remainder(rolling[:, None, :], self.primes[:, k - 1, :, None], out=out[:, k - 1])
        out += self._flat_shift if flat else self._col_shift

    def _hash_windows(self, windows: np.ndarray, flat: bool = False) -> np.ndarray:
        """windows int64 [P, N] -> row ids int64 [P, L, C] (a view of a [L, C, P] array);
        ``flat``: ids in the table's flat row space."""
        p = windows.shape[0]
        layers, orders, heads = self.primes.shape
        out = np.empty((layers, orders, heads, p), dtype=np.int64)
        if p <= _CHUNK:
            self._hash_windows_into(windows, out, flat)
        else:
            bounds = range(0, p, _CHUNK)
            parts = [np.empty((layers, orders, heads, min(_CHUNK, p - s)), np.int64) for s in bounds]
            list(_pool().map(lambda a: self._hash_windows_into(windows[a[0]:a[0] + _CHUNK], a[1], flat),
                             zip(bounds, parts)))
            np.concatenate(parts, axis=3, out=out)
        return out.reshape(layers, orders * heads, p).transpose(2, 0, 1)

    def _apply_dead(self, windows: np.ndarray, dead_windows: np.ndarray | None) -> np.ndarray:
        """Lookbacks at or beyond a dead token read the pad id."""
        if dead_windows is None:
            return windows
        reached = np.logical_or.accumulate(dead_windows, axis=1)  # [P, N]
        return np.where(reached, self.pad, windows)

    # ------------------------------------------------------------------ whole sequences
    def hash_all(
        self,
        input_ids: np.ndarray | torch.Tensor,
        dead_mask: np.ndarray | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, T]`` raw ids -> int64 ``[B, T, L, C]`` row ids (global within each layer).

        ``dead_mask`` ``[B, T]`` defaults to the image tokens (``dead_mask(input_ids)``).
        """
        ids = _as_numpy_ids(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {ids.shape}")
        b, t = ids.shape
        n = self._max_n
        comp = np.full((b, t + n - 1), self.pad, dtype=np.int64)
        comp[:, n - 1:] = self.compress(ids)
        # windows[b, p, k] = comp[b, p + n - 1 - k]
        windows = np.stack([comp[:, n - 1 - k: n - 1 - k + t] for k in range(n)], axis=-1)
        dead_windows = None
        if dead_mask is None:
            dead_mask = self.dead_mask(ids)
        if dead_mask is not None:
            dead = _as_numpy_mask(dead_mask)
            if dead.shape != ids.shape:
                raise ValueError(f"dead_mask shape {dead.shape} != input_ids shape {ids.shape}")
            dpad = np.zeros((b, t + n - 1), dtype=bool)
            dpad[:, n - 1:] = dead
            dead_windows = np.stack([dpad[:, n - 1 - k: n - 1 - k + t] for k in range(n)], axis=-1)
            dead_windows = dead_windows.reshape(b * t, n)
        windows = self._apply_dead(windows.reshape(b * t, n), dead_windows)
        rows = self._hash_windows(windows)  # [B*T, L, C]
        return torch.from_numpy(rows).unflatten(0, (b, t))

    def hash(
        self,
        input_ids: np.ndarray | torch.Tensor,
        dead_mask: np.ndarray | torch.Tensor | None = None,
    ) -> dict[int, torch.Tensor]:
        """``[B, T]`` raw ids -> {layer_id: int64 ``[B, T, (N-1)*H]``} global row ids in the layer."""
        rows = self.hash_all(input_ids, dead_mask)
        return {layer: rows[:, :, i] for i, layer in enumerate(self.config.layer_ids)}

    @overload
    def table_ids(self, rows: torch.Tensor) -> torch.Tensor: ...

    @overload
    def table_ids(self, rows: np.ndarray) -> np.ndarray: ...

    def table_ids(self, rows: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """Row ids ``[..., L, C]`` (global in each layer) -> ids in the table's flat row space,
        of the same kind (tensor or NumPy array).

        The serving path stays in NumPy until the step's ids are made: a torch op, and a
        tensor's end, let go of the GIL, and each let-go while another thread waits for the
        GIL costs a thread switch (tens of microseconds on a virtual CPU)."""
        if isinstance(rows, np.ndarray):
            return rows + self.layer_bases[:, None]
        return rows + torch.from_numpy(self.layer_bases).to(rows.device)[:, None]

    # ------------------------------------------------------------------ pieces
    def new_history(self, capacity: int = 64) -> "SequenceHistory":
        """Per-sequence state for hashing sequences piece by piece."""
        return SequenceHistory(self._max_n - 1, self.pad, capacity)

    def hash_decode(
        self,
        history: "SequenceHistory",
        seq_ids: Sequence[int],
        token_ids: np.ndarray | torch.Tensor | Sequence[int],
    ) -> torch.Tensor:
        """One new token per sequence (a decode step): ``[S]`` ids -> int64 ``[S, L, C]``.

        Equal to ``hash_pieces`` with one-token pieces, without per-sequence Python work.
        """
        return torch.from_numpy(self.decode_ids(history, seq_ids, token_ids))

    def decode_ids(self, history: "SequenceHistory", seq_ids: Sequence[int],
                   token_ids: np.ndarray | torch.Tensor | Sequence[int], *, flat: bool = False) -> np.ndarray:
        """``hash_decode`` as a NumPy array ``[S, L, C]`` (no tensor made: see ``table_ids``);
        ``flat``: ids in the table's flat row space (``table_ids`` of them, with no extra pass)."""
        tokens = _as_numpy_ids(token_ids).reshape(-1)
        if tokens.size != len(seq_ids):
            raise ValueError(f"{tokens.size} token ids for {len(seq_ids)} sequences")
        slots = history.slots_for(seq_ids)
        if self.dead_mask(tokens) is not None or (history.any_dead and history.dead[slots].any()):
            # a dead token among these n-grams (the last N-1 tokens): the general path
            return self.pieces_ids(history, seq_ids, tokens.reshape(-1, 1), flat=flat)
        comp = self.compress(tokens)
        windows = np.empty((tokens.size, self._max_n), np.int64)  # [S, N]: comp, then newest first
        if self._kernel is not None:  # no fancy indexing: each would let go of the GIL
            self._kernel.decode_windows(history.tokens, slots, np.ascontiguousarray(comp, np.int64), windows)
        else:
            remembered = history.tokens[slots]  # [S, N-1], oldest first
            windows[:, 0] = comp
            windows[:, 1:] = remembered[:, ::-1]
            history.tokens[slots, :-1] = remembered[:, 1:]
            history.tokens[slots, -1] = comp
        return self._hash_windows(windows, flat)

    def hash_pieces(
        self,
        history: "SequenceHistory",
        seq_ids: Sequence[int],
        pieces: Sequence[np.ndarray | torch.Tensor | Sequence[int]] | np.ndarray,
        dead: Sequence[np.ndarray | torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Hash the next piece of each sequence; returns int64 ``[sum(len(piece)), L, C]``.

        Pieces (or the rows of a 2-D array) are concatenated in ``seq_ids`` order. A sequence
        seen for the first time starts at its beginning; any split of a sequence gives the ids
        of hashing it whole. A piece whose ``dead`` entry is None (or all of them,
        ``dead=None``) takes the default mask, its image tokens.
        """
        return torch.from_numpy(self.pieces_ids(history, seq_ids, pieces, dead))

    def pieces_ids(
        self,
        history: "SequenceHistory",
        seq_ids: Sequence[int],
        pieces: Sequence[np.ndarray | torch.Tensor | Sequence[int]] | np.ndarray,
        dead: Sequence[np.ndarray | torch.Tensor | None] | None = None,
        *,
        flat: bool = False,
    ) -> np.ndarray:
        """``hash_pieces`` as a NumPy array ``[T, L, C]`` (no tensor made: see ``table_ids``);
        ``flat``: ids in the table's flat row space."""
        if len(seq_ids) != len(pieces) or (dead is not None and len(dead) != len(pieces)):
            raise ValueError("seq_ids, pieces (and dead) must have one entry per sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence may appear only once per step")
        arrays = [_as_numpy_ids(p).reshape(-1) for p in pieces]
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        slots = history.slots_for(seq_ids)
        h = self._max_n - 1
        raw = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
        comp = self.compress(raw)
        dead_new = self.dead_mask(raw)  # the default: image tokens
        if dead is not None and any(d is not None for d in dead):
            dead_new = np.zeros(raw.size, bool) if dead_new is None else dead_new
            starts = np.cumsum(lengths) - lengths
            for d, start, n_ in zip(dead, starts, lengths):
                if d is not None:
                    mask = _as_numpy_mask(d).reshape(-1)
                    if mask.size != n_:
                        raise ValueError(f"a dead mask of {mask.size} entries for a piece of {n_} tokens")
                    dead_new[start:start + n_] = mask
        has_dead = dead_new is not None
        if not has_dead:
            dead_new = np.zeros(raw.size, bool)
        # ext holds, per sequence, its h remembered tokens (oldest first) then its new piece.
        ext_len = lengths + h
        ext_start = np.cumsum(ext_len) - ext_len  # [S] (empty for no sequences)
        seq_of_new = np.repeat(np.arange(len(arrays)), lengths)
        rank_in_piece = np.arange(comp.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        new_pos = ext_start[seq_of_new] + h + rank_in_piece  # [total]
        hist_pos = (ext_start[:, None] + np.arange(h)[None]).reshape(-1)  # [S*h]
        ext = np.empty(int(ext_len.sum()), np.int64)
        ext_dead = np.empty(ext.size, bool)
        ext[hist_pos] = history.tokens[slots].reshape(-1)
        ext_dead[hist_pos] = history.dead[slots].reshape(-1)
        ext[new_pos] = comp
        ext_dead[new_pos] = dead_new
        # windows[i, k] = ext[new_pos[i] - k]
        gather = new_pos[:, None] - np.arange(h + 1)[None]  # [total, N]
        windows = self._apply_dead(ext[gather], ext_dead[gather] if has_dead or history.any_dead else None)
        # remember the last h tokens of every extended sequence
        tail = (ext_start + ext_len)[:, None] - h + np.arange(h)[None]  # [S, h]
        history.tokens[slots] = ext[tail]
        history.dead[slots] = ext_dead[tail]
        history.any_dead = history.any_dead or bool(ext_dead[tail].any())
        return self._hash_windows(windows, flat)


@dataclass
class SequenceHistory:
    """The last ``N-1`` compressed ids (and dead flags) of every sequence being hashed.

    Rows are slots; ``release(seq_id)`` frees a finished sequence's slot for reuse.
    """

    width: int
    pad: int
    capacity: int = 64
    tokens: np.ndarray = field(init=False)  # [capacity, N-1], oldest first
    dead: np.ndarray = field(init=False)  # [capacity, N-1]
    any_dead: bool = field(default=False, init=False)
    _slots: dict[int, int] = field(default_factory=dict, init=False)
    _free: list[int] = field(default_factory=list, init=False)
    _last_key: tuple | None = field(default=None, init=False)
    _last_slots: np.ndarray | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = np.full((self.capacity, self.width), self.pad, np.int64)
        self.dead = np.zeros((self.capacity, self.width), bool)
        self._free = list(range(self.capacity - 1, -1, -1))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slots_for(self, seq_ids: Sequence[int]) -> np.ndarray:
        """Slot of each sequence, allocating (at the sequence start) for new ones.

        Decode steps repeat the previous step's batch, so that answer is kept and reused.
        """
        key = tuple(seq_ids)
        if key == self._last_key and self._last_slots is not None:
            return self._last_slots
        out = np.empty(len(seq_ids), np.int64)
        for i, seq in enumerate(seq_ids):
            slot = self._slots.get(seq)
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._free.pop()
                self._slots[seq] = slot
                self.tokens[slot] = self.pad
                self.dead[slot] = False
            out[i] = slot
        self._last_key, self._last_slots = key, out
        return out

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence; its next piece would start a new sequence."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._last_key = None
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        self.tokens = np.concatenate([self.tokens, np.full((old, self.width), self.pad, np.int64)])
        self.dead = np.concatenate([self.dead, np.zeros((old, self.width), bool)])
        self._free.extend(range(self.capacity - 1, old - 1, -1))
