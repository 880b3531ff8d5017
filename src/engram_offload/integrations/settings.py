"""The operator's settings for an engine plugin, the store they open, and the start-up checks.

Both engines take one JSON dict with the same keys (vLLM: ``--additional-config
'{"engram_offload": {...}}'``; SGLang: the ``ENGRAM_OFFLOAD_CONFIG`` environment variable).
``table`` and ``tier`` are required: a tier, or ``auto`` for one chosen from this machine's free
DRAM and disk at start-up (``auto.resolve_tier``). A key this module does not know is refused
(a typo would otherwise silently serve from the wrong tier).

A tier is either *addressable* (``memory``, ``pinned``, ``shared``: the whole table in host
memory the GPU reads in place, so a lookup is one kernel on the current stream) or *host
read* (``mmap``, ``direct``, ``remote``, or any tier behind a row server: the rows are read by
a host thread and copied to the device, which Python must drive every step).

The checks fail closed at start-up, each with one line saying what to change: the table
must have been converted from the checkpoint the engine loads (same Engram layout: layers,
head primes, head dim, fp8 rows), and a host-read tier cannot run under a CUDA-graph mode
that replays captured work without Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence, cast

from ..cache.policy import DEFAULT_POLICY, POLICIES
from ..engram.config import EngramConfig
from ..serving.layered import is_layered, parse_placement, placement_text
from ..serving.sharding import Columns
from ..serving.store import RowStore, open_table
from ..tiers import is_resident, tier_names
from ..units import parse_size

__all__ = ["ADDRESSABLE_TIERS", "AUTO", "HOST_READ_TIERS", "OffloadSettings", "check_graph_mode", "check_layout",
           "open_store", "parse_settings", "settings_from_json"]

ADDRESSABLE_TIERS = tier_names(addressable=True)  # the GPU reads the table in place
HOST_READ_TIERS = tier_names(addressable=False)  # a host thread reads the rows
AUTO = "auto"  # the tier chosen at start-up from the machine's facts (``auto.resolve_tier``)
AUTO_TIERS = ("pinned", "shared", "direct")  # what auto chooses among (never remote: a pool is the operator's)
AUTO_REFUSES = ("cache_bytes", "fast_cache_bytes", "queue_depth", "verify_reads", "row_server", "pool", "fallback")
ENGRAM_ROW_FORMAT = "fp8_e4m3_ue8m0"  # what DeepSeek-V4.1's checkpoint holds and both engines read
ENGRAM_BLOCK = 32  # values per ue8m0 scale


@dataclass(frozen=True)
class OffloadSettings:
    """What an operator sets (see ``docs/serving.md``); sizes in bytes."""

    table: str  # a table file from `engram-offload convert`, or a pool URL redis://.../FINGERPRINT
    tier: str  # one of ADDRESSABLE_TIERS + HOST_READ_TIERS, AUTO (resolved at start-up), or a placement
    #            "1=pinned/14=direct" (each Engram layer on its own tier; JSON also {"1": "pinned", ...})
    cache_bytes: int | None = None  # DRAM row cache in front of a host-read tier
    fast_cache_bytes: int = 0  # a faster cache above it (host RAM; not with an addressable tier)
    policy: str = DEFAULT_POLICY
    admission: bool | None = None
    row_server: str | None = None  # the machine's row server socket: it owns the tier and the cache
    pool: str | None = None  # the remote tier's Redis pool URL
    fallback: str | None = None  # the remote tier's local table
    staging_bytes: int | None = None  # pinned staging of a host-read lookup (default: one step's rows)
    queue_depth: int | None = None  # the direct tier's io_uring depth
    verify_reads: bool | None = None  # check every page read against the table's checksums
    log_every: int = 1000  # log the tier, hit rate and stall every N lookups of a layer (0: never)
    wait_timeout_s: float = 60.0  # the longest a lookup waits for a host read before raising
    allow_untested_engine: bool = False  # run on an engine version the plugin was not tested with (warned)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers the settings use: ``tier``, or each layer's of a placement (``"1=pinned/14=direct"``)."""
        return tuple(parse_placement(self.tier).values()) if is_layered(self.tier) else (self.tier,)

    def tier_of(self, layer_id: int) -> str:
        """The tier of Engram layer ``layer_id`` (a placement names each layer's)."""
        return parse_placement(self.tier)[layer_id] if is_layered(self.tier) else self.tier

    def reads_on_host(self, layer_id: int | None = None) -> bool:
        """Whether a host thread reads the rows of ``layer_id`` (None: of any layer); else the GPU
        reads them in place."""
        tiers = self.tiers if layer_id is None else (self.tier_of(layer_id),)
        return self.row_server is not None or any(t not in ADDRESSABLE_TIERS for t in tiers)

    @property
    def host_read(self) -> bool:
        """Whether any layer's rows are read by a host thread (else the GPU reads the table in place)."""
        return self.reads_on_host()

    def store_key(self) -> tuple[Any, ...]:
        """Settings that open the same store (one store per process and column shard)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in ("log_every", "wait_timeout_s", "allow_untested_engine"))


_SIZES = ("cache_bytes", "fast_cache_bytes", "staging_bytes")
_BOOLS = ("admission", "verify_reads", "allow_untested_engine")
_STRINGS = ("table", "tier", "policy", "row_server", "pool", "fallback")
MIN_WAIT_S, MAX_WAIT_S = 1e-3, 86400.0  # wait_timeout_s: a millisecond to a day
KEYS = tuple(f.name for f in fields(OffloadSettings))


def parse_settings(raw: Mapping[str, Any]) -> OffloadSettings:
    """A settings dict -> ``OffloadSettings``; ``ValueError`` (one line) for an unknown key, a
    missing ``table`` or ``tier``, a wrong type, an unknown tier or policy."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"engram_offload settings must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown engram_offload setting(s) {', '.join(map(repr, unknown))}: "
                         f"the keys are {', '.join(KEYS)}")
    if not raw.get("table"):
        raise ValueError("engram_offload needs 'table': a table file from `engram-offload convert` or a pool URL")
    tiers = ADDRESSABLE_TIERS + HOST_READ_TIERS
    if raw.get("tier") is None:
        raise ValueError(f"engram_offload needs 'tier': one of {', '.join(tiers)}, or \"{AUTO}\" to choose from this "
                         "machine's free DRAM and disk")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue
        if key == "tier" and is_layered(value):  # each Engram layer on its own tier
            values[key] = placement_text(parse_placement(value))
            continue
        if key in _SIZES:
            values[key] = parse_size(value)
        elif key in _BOOLS:
            if not isinstance(value, bool):
                raise ValueError(f"engram_offload setting {key!r} must be true or false, got {value!r}")
            values[key] = value
        elif key in _STRINGS:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"engram_offload setting {key!r} must be a string, not blank, got {value!r}")
            values[key] = value
        elif key in ("queue_depth", "log_every"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "queue_depth" else 0):
                raise ValueError(f"engram_offload setting {key!r} must be an integer >= "
                                 f"{1 if key == 'queue_depth' else 0}, got {value!r}")
            values[key] = value
        else:  # wait_timeout_s
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not MIN_WAIT_S <= value <= MAX_WAIT_S:
                raise ValueError(f"engram_offload setting {key!r} must be a number of seconds from {MIN_WAIT_S:g} "
                                 f"to {MAX_WAIT_S:g}, got {value!r}")
            values[key] = float(value)
    settings = OffloadSettings(**values)
    used = settings.tiers
    if is_layered(settings.tier) and settings.row_server is not None:
        raise ValueError("the row server owns the tier of every layer: drop row_server, or give one tier (the "
                         "server's)")
    if not is_layered(settings.tier) and settings.tier not in tiers + (AUTO,):
        raise ValueError(f"engram_offload tier {settings.tier!r} is unknown: choose one of {', '.join(tiers)}, "
                         f"or {AUTO}")
    if settings.tier == AUTO:
        given = [key for key in AUTO_REFUSES if raw.get(key) is not None]
        if given:
            raise ValueError(f"tier auto chooses among {', '.join(AUTO_TIERS)} and sizes the row cache itself: drop "
                             f"{', '.join(given)}, or name a tier")
        if settings.table.startswith("redis://"):
            raise ValueError("tier auto chooses a tier of this machine, and a pool URL is read by the remote tier: "
                             "set tier to remote")
    if settings.policy not in POLICIES:
        raise ValueError(f"engram_offload policy {settings.policy!r} is unknown: choose one of {', '.join(POLICIES)}")
    named = "/".join(dict.fromkeys(used))
    if (settings.pool or settings.fallback) and "remote" not in used:
        raise ValueError(f"pool and fallback are the remote tier's settings, not the {named} tier's: "
                         "set tier to remote or drop them")
    if "remote" in used and not settings.pool and not settings.table.startswith("redis://") \
            and settings.row_server is None:
        raise ValueError("the remote tier needs 'pool' (the pool's redis:// URL) or a pool URL as 'table'")
    if settings.queue_depth is not None and "direct" not in used:
        raise ValueError(f"queue_depth is the direct tier's io_uring depth, not the {named} tier's: drop it")
    if settings.verify_reads is not None and used == ("remote",):
        raise ValueError("the remote tier checks every row against its pool checksum: drop verify_reads")
    if settings.verify_reads is not None and not any(is_resident(t) for t in used):
        raise ValueError(f"the {named} tier checks every page it reads: drop verify_reads")
    if not settings.host_read and (settings.cache_bytes or settings.fast_cache_bytes):
        raise ValueError(f"the {named} tier holds the whole table in memory the GPU reads in place: "
                         "drop cache_bytes and fast_cache_bytes")
    return settings


def settings_from_json(text: str, where: str) -> OffloadSettings:
    """Settings from a JSON string (``where`` names its source in the error)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise ValueError(f"{where} is not valid JSON (nested too deeply to read): give one flat object") from None
    return parse_settings(raw)


def _resolved(settings: OffloadSettings) -> None:
    """Refuse settings whose tier is still ``auto``."""
    if settings.tier == AUTO:
        raise ValueError("tier auto is chosen at start-up: pass the settings through auto.resolve_tier first")


def open_store(settings: OffloadSettings, columns: Columns | None) -> RowStore:
    """The host store the settings describe, serving the rows of ``columns`` (a rank's shard)."""
    _resolved(settings)
    options: dict[str, Any] = {}
    for key in ("queue_depth", "verify_reads", "pool", "fallback"):
        value = getattr(settings, key)
        if value is not None:
            options[key] = value
    if settings.row_server is not None:
        client = open_table(settings.table, settings.tier, row_server=settings.row_server, columns=columns, **options)
        return cast(RowStore, client)  # rows on the host: its sync is always None
    return open_table(settings.table, settings.tier, cache_bytes=settings.cache_bytes,
                      fast_cache_bytes=settings.fast_cache_bytes, policy=settings.policy,
                      admission=settings.admission, columns=columns, **options)


def check_layout(table: EngramConfig, where: str, *, layer_ids: Sequence[int], head_dim: int,
                 primes: Sequence[Sequence[Sequence[int]]], num_embeddings: Sequence[int] | None = None) -> None:
    """Refuse a table whose Engram layout differs from the checkpoint's (``ValueError``, one line).

    ``primes``: per layer, per n-gram order, per head, the bucket primes the engine derived
    from the checkpoint's config; ``num_embeddings``: the rows per layer it declares.
    """
    def refuse(what: str) -> None:
        raise ValueError(f"the table {where} was converted from another model ({what}): convert this "
                         "checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")

    if tuple(table.layer_ids) != tuple(int(i) for i in layer_ids):
        refuse(f"Engram layers {list(table.layer_ids)}, the checkpoint's {list(layer_ids)}")
    if table.head_dim != head_dim:
        refuse(f"head_dim {table.head_dim}, the checkpoint's {head_dim}")
    if table.row_format != ENGRAM_ROW_FORMAT:
        refuse(f"{table.row_format} rows, the checkpoint's {ENGRAM_ROW_FORMAT}")
    for index, layer_id in enumerate(table.layer_ids):
        ours = tuple(tuple(order) for order in table.primes[layer_id])
        theirs = tuple(tuple(int(p) for p in order) for order in primes[index])
        if ours != theirs:
            refuse(f"layer {layer_id}'s head primes differ (first heads {ours[0][:2]} vs {theirs[0][:2]})")
        if num_embeddings is not None and table.rows_per_layer[layer_id] > int(num_embeddings[index]):
            refuse(f"layer {layer_id} has {table.rows_per_layer[layer_id]} rows, the checkpoint "
                   f"{int(num_embeddings[index])}")


def check_graph_mode(settings: OffloadSettings, full_graphs: bool, fix: str, layer_id: int | None = None) -> None:
    """Refuse a host-read tier (of ``layer_id``; None: of any layer) when the engine replays FULL
    CUDA graphs (the host read would run once at capture and never again); ``fix`` names the
    engine's flag that avoids it."""
    _resolved(settings)
    if settings.reads_on_host(layer_id) and full_graphs:
        tier = settings.tier_of(layer_id) if layer_id is not None else "/".join(
            t for t in dict.fromkeys(settings.tiers) if t not in ADDRESSABLE_TIERS)
        where = f"the row server at {settings.row_server}" if settings.row_server else f"the {tier} tier"
        raise ValueError(f"{where} reads rows on the host, which a FULL CUDA graph cannot replay: {fix}, "
                         f"or use a tier the GPU reads in place ({', '.join(ADDRESSABLE_TIERS)})")
