"""``EngramConfig``: an Engram model's layout, its presets, and the derived table geometry.

The layout follows SPEC section 2: per layer and n-gram order, ``n_heads`` distinct primes
(searched upward from the order's prime-search start, never reused across layers or
orders) size the heads; a layer's rows are its heads' rows back to back; a table file
holds every layer's rows back to back in one flat row-id space.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .rows import get_row_format

__all__ = ["EngramConfig", "PRESETS", "check_config_fields", "is_prime", "next_unused_prime"]

VARIANTS = ("demo", "v4.1")
LAYER_SEED_PRIME = 10007


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24 (so every int64)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, seen: set[int]) -> int:
    """The smallest prime ``> start`` that is not in ``seen``."""
    candidate = start + 1
    while candidate in seen or not is_prime(candidate):
        candidate += 1
    return candidate


# Bounds of the config fields: far above any real model, and they keep the prime search short.
MAX_TOTAL_HEADS = 4096
CONFIG_INT_RANGES = {
    "max_ngram_size": (2, 16),
    "n_heads": (1, 1024),
    "head_dim": (1, 1 << 16),
    "seed": (0, 2**63 - 1),
    "pad_id": (-(2**31), 2**31 - 1),
    "hidden_size": (1, 1 << 20),
    "hc_mult": (1, 1024),
    "kernel_size": (1, 1024),
}
LAYER_ID_RANGE = (0, 1 << 16)
PRIME_START_RANGE = (1, 1 << 48)
COMPRESSED_VOCAB_RANGE = (1, 1 << 40)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(name: str, value: Any) -> int:
    """``value`` as an int when it is one (or a float with no fraction, as JSON may write
    ``8.0``); ``ValueError`` naming the field otherwise, never a silent truncation of 2.7 to 2."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, (bool, float, np.bool_)):
        try:
            return operator.index(value)  # int and NumPy's integers
        except TypeError:
            pass
    raise ValueError(f"{name} must be a whole number, got {value!r}")


def check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def check_config_fields(fields: Any) -> None:
    """Check the types and ranges of an ``EngramConfig``'s fields (``to_dict()`` form) before
    anything derives a layout from them; raise ``ValueError`` naming the first bad field.

    The bounds (``CONFIG_INT_RANGES``, ``MAX_TOTAL_HEADS``, ...) are far above any real
    model and keep the prime search short.
    """
    if not isinstance(fields, dict):
        raise ValueError(f"the config must be a JSON object, got {type(fields).__name__}")
    for name, (lo, hi) in CONFIG_INT_RANGES.items():
        if name in fields:
            check_int(name, fields[name], lo, hi)
    layer_ids = fields.get("layer_ids")
    if not isinstance(layer_ids, list) or not 1 <= len(layer_ids) <= 256:
        raise ValueError(f"layer_ids must be a list of 1 to 256 layer ids, got {layer_ids!r}")
    for i in layer_ids:
        check_int("a layer id", i, *LAYER_ID_RANGE)
    starts = fields.get("prime_starts")
    for start in starts if isinstance(starts, list) else [starts]:
        check_int("a prime-search start", start, *PRIME_START_RANGE)
    orders, n_heads = fields.get("max_ngram_size", 2) - 1, fields.get("n_heads", 1)
    heads = len(layer_ids) * orders * n_heads
    if heads > MAX_TOTAL_HEADS:
        raise ValueError(
            f"{len(layer_ids)} layers x {orders} orders x {n_heads} "
            f"heads = {heads:,} hashed heads, more than the {MAX_TOTAL_HEADS:,} supported"
        )
    eps = fields.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
    if fields.get("compressed_vocab_size") is not None:
        check_int("compressed_vocab_size", fields["compressed_vocab_size"], *COMPRESSED_VOCAB_RANGE)
    for name in ("variant", "row_format"):
        if name in fields and not isinstance(fields[name], str):
            raise ValueError(f"{name} must be a string, got {fields[name]!r}")
    if fields.get("name") is not None and not isinstance(fields["name"], str):
        raise ValueError(f"name must be a string or null, got {fields['name']!r}")


@dataclass(frozen=True)
class EngramConfig:
    """An Engram layout plus the few backbone facts its layer needs.

    ``prime_starts`` holds one prime-search start per n-gram order (``max_ngram_size - 1``
    values; the demo's ``engram_vocab_size`` list, or V4.1's single value repeated).
    ``pad_id`` is a raw token id; the hasher maps it through the token compression.
    ``image_token_id`` (V4.1's image placeholder) is a dead token: hashing and the gate
    treat it as SPEC section 3 says, unless a caller passes its own dead mask.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    prime_starts: tuple[int, ...]
    seed: int = 0
    pad_id: int = 2
    hidden_size: int = 1024
    hc_mult: int = 4
    kernel_size: int = 4
    variant: str = "demo"
    row_format: str = "fp32"
    rms_norm_eps: float = 1e-6
    compressed_vocab_size: int | None = None
    image_token_id: int | None = None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(whole_number("a layer id", i) for i in self.layer_ids))
        starts = self.prime_starts
        if isinstance(starts, (int, float)):
            starts = (starts,) * (self.max_ngram_size - 1)
        object.__setattr__(self, "prime_starts", tuple(whole_number("a prime-search start", s) for s in starts))
        if not self.layer_ids:
            raise ValueError("layer_ids is empty: an Engram config needs at least one layer")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids has duplicates: {list(self.layer_ids)}")
        if self.max_ngram_size < 2:
            raise ValueError(f"max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if self.n_heads < 1 or self.head_dim < 1:
            raise ValueError(
                f"n_heads and head_dim must be positive, got {self.n_heads} and {self.head_dim}"
            )
        if len(self.prime_starts) != self.max_ngram_size - 1:
            raise ValueError(
                f"prime_starts needs one value per n-gram order ({self.max_ngram_size - 1}), "
                f"got {len(self.prime_starts)}: {list(self.prime_starts)}"
            )
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        get_row_format(self.row_format).row_bytes(self.head_dim)  # validates the pair
        check_config_fields(self.to_dict())

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_name(cls, name: str) -> "EngramConfig":
        """A named preset (SPEC section 6): see ``PRESETS``."""
        try:
            return cls(**PRESETS[name], name=name)
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}"
            ) from None

    @classmethod
    def from_hf_config(cls, source: str | Path | Mapping[str, Any]) -> "EngramConfig":
        """Read a Hugging Face ``config.json`` (path, its folder, or dict) with ``engram_*`` fields.

        Both layouts are read: the released DeepSeek-V4.1 one (``engram_*``, ``hidden_size``,
        ``hc_mult`` and ``rms_norm_eps`` under ``text_config``; ``quantization_config`` and
        ``image_token_id`` at the top level) and a flat one. An fp8 ``quantization_config``
        (``quant_method`` "fp8" or ``fmt`` "e4m3") means ``fp8_e4m3_ue8m0`` rows, otherwise
        bf16; ``engram_row_format`` overrides both. When ``engram_num_embeddings`` is given
        it must equal each layer's row count derived from the primes.
        """
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"no Hugging Face config at {path}") from None
        else:
            data = dict(source)
        text = data.get("text_config")
        if "engram_layer_ids" not in data and isinstance(text, Mapping):
            data = {**data, **text}  # the text model's fields win; top-level ones stay visible
        missing = [
            k
            for k in ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads",
                      "engram_head_dim", "engram_vocab_size")
            if k not in data
        ]
        if missing:
            raise ValueError(f"config.json lacks the Engram fields {missing}")
        n = whole_number("engram_max_ngram_size", data["engram_max_ngram_size"])
        vocab = data["engram_vocab_size"]
        starts = tuple(vocab) if isinstance(vocab, (list, tuple)) else (whole_number("engram_vocab_size", vocab),) * (n - 1)
        quant = data.get("quantization_config") or {}
        fp8 = quant.get("fmt") == "e4m3" or quant.get("quant_method") == "fp8"
        image = data.get("image_token_id")
        config = cls(
            layer_ids=tuple(data["engram_layer_ids"]),
            max_ngram_size=n,
            n_heads=whole_number("engram_n_heads", data["engram_n_heads"]),
            head_dim=whole_number("engram_head_dim", data["engram_head_dim"]),
            prime_starts=starts,
            pad_id=whole_number("engram_pad_token_id", data.get("engram_pad_token_id", data.get("engram_pad_id", 2))),
            hidden_size=whole_number("hidden_size", data.get("hidden_size", 1024)),
            hc_mult=whole_number("hc_mult", data.get("hc_mult", 4)),
            variant="v4.1",
            row_format=data.get("engram_row_format", "fp8_e4m3_ue8m0" if fp8 else "bf16"),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            compressed_vocab_size=data.get("engram_compressed_vocab_size") or None,
            image_token_id=None if image is None else whole_number("image_token_id", image),
        )
        declared = data.get("engram_num_embeddings")
        if declared is not None:
            declared = [whole_number("engram_num_embeddings", declared)] * len(config.layer_ids) \
                if not isinstance(declared, (list, tuple)) else [whole_number("engram_num_embeddings", x) for x in declared]
            derived = [config.rows_per_layer[i] for i in config.layer_ids]
            if declared != derived:
                raise ValueError(
                    f"engram_num_embeddings {declared} disagrees with the rows derived from the "
                    f"primes {derived} (layers {list(config.layer_ids)}, prime start "
                    f"{list(config.prime_starts)}): check engram_vocab_size, engram_n_heads and "
                    "engram_max_ngram_size"
                )
        return config

    @classmethod
    def from_demo(cls, **fields_: Any) -> "EngramConfig":
        """Accept the demo's ``EngramConfig`` and ``BackBoneConfig`` field names."""
        ignored = {"tokenizer_name_or_path", "vocab_size", "num_layers", "tokenizer_vocab_size"}
        known = {
            "engram_vocab_size", "max_ngram_size", "n_embed_per_ngram", "n_head_per_ngram",
            "layer_ids", "pad_id", "seed", "kernel_size", "hidden_size", "hc_mult",
        }
        unknown = set(fields_) - known - ignored
        if unknown:
            raise ValueError(f"unknown demo config fields: {sorted(unknown)}")
        n = whole_number("max_ngram_size", fields_.get("max_ngram_size", 3))
        heads = whole_number("n_head_per_ngram", fields_.get("n_head_per_ngram", 8))
        width = whole_number("n_embed_per_ngram", fields_.get("n_embed_per_ngram", 512))
        if width % heads:
            raise ValueError(
                f"n_embed_per_ngram ({width}) must be divisible by n_head_per_ngram ({heads})"
            )
        vocab = fields_.get("engram_vocab_size", [129280 * 5] * (n - 1))
        return cls(
            layer_ids=tuple(fields_.get("layer_ids", (1, 15))),
            max_ngram_size=n,
            n_heads=heads,
            head_dim=width // heads,
            prime_starts=tuple(vocab) if isinstance(vocab, (list, tuple)) else (whole_number("engram_vocab_size", vocab),) * (n - 1),
            seed=whole_number("seed", fields_.get("seed", 0)),
            pad_id=whole_number("pad_id", fields_.get("pad_id", 2)),
            hidden_size=whole_number("hidden_size", fields_.get("hidden_size", 1024)),
            hc_mult=whole_number("hc_mult", fields_.get("hc_mult", 4)),
            kernel_size=whole_number("kernel_size", fields_.get("kernel_size", 4)),
            variant="demo",
            row_format="fp32",
        )

    def replace(self, **changes: Any) -> "EngramConfig":
        """A copy with some fields changed (derived layout recomputed)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngramConfig(**values)

    def scaled(self, factor: float) -> "EngramConfig":
        """The same layout with every prime-search start scaled by ``factor`` (smaller tables)."""
        if not 0 < factor <= 1:
            raise ValueError(f"scale must be in (0, 1], got {factor}")
        if factor == 1:
            return self
        starts = tuple(max(self.n_heads * 2, int(s * factor)) for s in self.prime_starts)
        name = f"{self.name}@{factor:g}" if self.name else None
        return self.replace(prime_starts=starts, name=name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (round-trips through ``EngramConfig(**d)``)."""
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        d["prime_starts"] = list(self.prime_starts)
        return d

    # ---------------------------------------------------------------- derived layout
    @property
    def num_orders(self) -> int:
        return self.max_ngram_size - 1

    @property
    def cols_per_layer(self) -> int:
        """Row ids per position per layer: ``(N-1) * H``."""
        return self.num_orders * self.n_heads

    @cached_property
    def primes(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """layer_id -> per order -> per head prime (the head's row count)."""
        seen: set[int] = set()
        out: dict[int, tuple[tuple[int, ...], ...]] = {}
        for layer_id in self.layer_ids:
            per_order = []
            for order in range(self.num_orders):
                start, heads = self.prime_starts[order] - 1, []
                for _ in range(self.n_heads):
                    start = next_unused_prime(start, seen)
                    seen.add(start)
                    heads.append(start)
                per_order.append(tuple(heads))
            out[layer_id] = tuple(per_order)
        return out

    def head_sizes(self, layer_id: int) -> tuple[int, ...]:
        """A layer's ``(N-1)*H`` head row counts in (order, head) order."""
        return tuple(p for order in self.primes[self._check_layer(layer_id)] for p in order)

    def head_offsets(self, layer_id: int) -> tuple[int, ...]:
        """Exclusive prefix sums of ``head_sizes``: a head's first row within its layer."""
        sizes = self.head_sizes(layer_id)
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))

    @cached_property
    def rows_per_layer(self) -> dict[int, int]:
        return {i: sum(self.head_sizes(i)) for i in self.layer_ids}

    def layer_row_base(self, layer_id: int) -> int:
        """A layer's first row in the table's flat row-id space (layers back to back)."""
        base = 0
        for i in self.layer_ids:
            if i == self._check_layer(layer_id):
                return base
            base += self.rows_per_layer[i]
        raise AssertionError

    @cached_property
    def layer_row_bases(self) -> tuple[int, ...]:
        """``layer_row_base`` of every layer, in ``layer_ids`` order."""
        return tuple(self.layer_row_base(i) for i in self.layer_ids)

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_layer.values())

    @property
    def row_bytes(self) -> int:
        return get_row_format(self.row_format).row_bytes(self.head_dim)

    @property
    def table_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def rows_per_token(self) -> int:
        return len(self.layer_ids) * self.cols_per_layer

    @property
    def bytes_per_token(self) -> int:
        return self.rows_per_token * self.row_bytes

    def bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """Bytes one rank reads per token when each layer's heads are split over ``tp`` ranks."""
        if tp < 1:
            raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
        cols = math.ceil(self.cols_per_layer / tp)
        return len(self.layer_ids) * cols * self.row_bytes

    def multipliers(self, layer_id: int, compressed_vocab_size: int) -> np.ndarray:
        """The layer's ``N`` odd hash multipliers (int64), per SPEC section 2."""
        bound = max(1, ((2**63 - 1) // compressed_vocab_size) // 2)
        rng = np.random.default_rng(self.seed + LAYER_SEED_PRIME * self._check_layer(layer_id))
        return rng.integers(0, bound, size=self.max_ngram_size, dtype=np.int64) * 2 + 1

    def _check_layer(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise KeyError(f"layer {layer_id} is not an Engram layer; Engram layers: {list(self.layer_ids)}")
        return layer_id


# Presets (SPEC section 6). Backbone widths not in SPEC are noted where assumed.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V4.1-Flash, as its released config.json declares (SPEC section 4): engram_*,
    # hidden_size 5120, hc_mult 4 and rms_norm_eps 1e-20 under text_config, image_token_id
    # 129,264 and the fp8 quantization_config at the top level. Pad id 2 is the DeepSeek-V3/V4
    # tokenizer's "<｜▁pad▁｜>".
    "deepseek-v4.1-flash": dict(
        layer_ids=(1, 14), max_ngram_size=4, n_heads=8, head_dim=256,
        prime_starts=(16_000_000,) * 3, pad_id=2, hidden_size=5120, hc_mult=4,
        variant="v4.1", row_format="fp8_e4m3_ue8m0", rms_norm_eps=1e-20,
        compressed_vocab_size=99_092, image_token_id=129_264,
    ),
    # Engram paper (arXiv 2601.07372), 27B: layers 2 and 15, 2- and 3-grams, 8 heads, 80-wide
    # bf16 rows, 5.7B table parameters. Backbone width 2560 is an assumption (not in SPEC).
    "engram-27b": dict(
        layer_ids=(2, 15), max_ngram_size=3, n_heads=8, head_dim=80,
        prime_starts=(2_262_400,) * 2, hidden_size=2560, hc_mult=4,
        variant="demo", row_format="bf16",
    ),
    # Engram paper, 40B: same layout with 18.5B table parameters.
    "engram-40b": dict(
        layer_ids=(2, 15), max_ngram_size=3, n_heads=8, head_dim=80,
        prime_starts=(7_239_680,) * 2, hidden_size=2560, hc_mult=4,
        variant="demo", row_format="bf16",
    ),
    # The defaults of DeepSeek's engram_demo_v1.py (EngramConfig + BackBoneConfig).
    "deepseek-demo": dict(
        layer_ids=(1, 15), max_ngram_size=3, n_heads=8, head_dim=64,
        prime_starts=(129280 * 5,) * 2, pad_id=2, hidden_size=1024, hc_mult=4,
        kernel_size=4, variant="demo", row_format="fp32",
    ),
}
