"""A safetensors checkpoint's Engram tensors: where they are, and reading only those.

Names (SPEC section 4). The released DeepSeek-V4.1 shards name a layer's tensors
``layers.{L}.engram.*`` (a ``model.`` prefix, as serving engines write them, is accepted):

- ``embed.weight`` float8_e4m3fn ``[rows, d]`` and its ue8m0 scales ``[rows, d/32]``, stored as
  ``embed.scale``; ``embed.weight_scale_inv`` and vLLM's ``embed_tokens.weight_scale_inv``
  (with ``embed_tokens.weight``) are accepted too;
- ``wkv.weight`` (float8_e4m3fn with ue8m0 block scales ``wkv.scale``, or plain floats),
  ``q_weight``, ``k_weight``;
- demo checkpoints: the demo module's state-dict names (``multi_head_embedding.embedding.weight``, ...).

``model.safetensors.index.json``, when present, says which shard holds which tensor, so only
the shards holding a layer's Engram tensors are opened (its shard names must be plain file
names of the folder); without it every shard's header (never its data) is read to find them,
and a tensor found in two shards is an error (which one is meant is not known).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = [
    "CheckpointIndex",
    "EMBED_WEIGHT_NAMES",
    "EMBED_SCALE_NAMES",
    "WKV_SCALE_NAMES",
    "DEMO_EMBED_NAME",
    "INDEX_FILE",
    "pick",
    "missing_message",
    "open_shard",
]

INDEX_FILE = "model.safetensors.index.json"
EMBED_WEIGHT_NAMES = ("embed.weight", "embed_tokens.weight")
EMBED_SCALE_NAMES = ("embed.scale", "embed.weight_scale_inv", "embed_tokens.weight_scale_inv")
WKV_SCALE_NAMES = ("wkv.scale", "wkv.weight_scale_inv")
DEMO_EMBED_NAME = "multi_head_embedding.embedding.weight"

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def engram_suffix(name: str) -> tuple[int, str] | None:
    """``(layer_id, name within the layer's Engram module)`` of a checkpoint tensor, or None."""
    m = _LAYER.search(name)
    if m is None:
        return None
    rest = m.group(2)
    if rest.startswith("engram."):
        return int(m.group(1)), rest[len("engram."):]
    if rest.endswith(DEMO_EMBED_NAME):  # a demo embedding under another module name
        return int(m.group(1)), DEMO_EMBED_NAME
    return None


@dataclass
class CheckpointIndex:
    """Which shard holds each tensor of a checkpoint folder, and its Engram tensors by layer."""

    root: Path
    shard_of: dict[str, Path]

    @classmethod
    def open(cls, checkpoint: str | os.PathLike[str]) -> "CheckpointIndex":
        """Read ``model.safetensors.index.json``, or else the header of every shard."""
        root = Path(checkpoint)
        index = root / INDEX_FILE
        if index.is_file():
            return cls(root, _read_index(index))
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors shards and no {INDEX_FILE} in {root}")
        shard_of: dict[str, Path] = {}
        for shard in shards:
            with open_shard(shard) as f:
                for name in f.keys():
                    if name in shard_of:
                        raise ValueError(
                            f"tensor {name} is in two shards, {shard_of[name].name} and {shard.name}, and "
                            f"{root} has no {INDEX_FILE} to say which is meant: remove the stale shard or "
                            "add the checkpoint's index"
                        )
                    shard_of[name] = shard
        return cls(root, shard_of)

    def engram_layers(self) -> dict[int, dict[str, str]]:
        """layer_id -> {name within the Engram module: full tensor name}."""
        out: dict[int, dict[str, str]] = defaultdict(dict)
        for name in self.shard_of:
            found = engram_suffix(name)
            if found is not None:
                layer, suffix = found
                if suffix in out[layer]:
                    raise ValueError(
                        f"layer {layer} has two Engram tensors named {suffix}: "
                        f"{out[layer][suffix]} and {name}"
                    )
                out[layer][suffix] = name
        return dict(out)

    def layer_tensors(self, layer_id: int) -> dict[str, str]:
        """One layer's Engram tensors (name within the module -> full name); error if none."""
        layers = self.engram_layers()
        if layer_id not in layers:
            raise KeyError(
                f"{self.root} has no Engram tensors for layer {layer_id} (looked for "
                f"'layers.{layer_id}.engram.*'); its Engram layers: {sorted(layers)}"
            )
        return layers[layer_id]

    def read(self, names: Iterable[str]) -> dict[str, Any]:
        """The named tensors, each shard holding one of them opened once; no other tensor read."""
        by_shard: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_shard[self.shard_of[name]].append(name)
        out: dict[str, Any] = {}
        for shard, shard_names in by_shard.items():
            with open_shard(shard) as f:
                out.update((name, f.get_tensor(name)) for name in shard_names)
        return out


def _read_index(index: Path) -> dict[str, Path]:
    """``weight_map`` of a ``model.safetensors.index.json``: tensor name -> shard path in its
    folder; ``ValueError`` naming the file for anything else (not UTF-8 JSON, not an object, a
    shard name that is not a plain file name of the folder)."""
    where = f"{index} is not a safetensors index"
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{where} (not UTF-8 text): re-download it or remove it") from None
    except ValueError as exc:
        raise ValueError(f"{where} (not valid JSON: {exc}): re-download it or remove it") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = "no weight_map object" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise ValueError(f"{where} ({found}, expected an object with a weight_map): re-download it or remove it")
    shard_of: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\\" in shard \
                or "\0" in shard:
            raise ValueError(f"{where}: tensor {name} maps to {shard!r}, not a shard file name in "
                             f"{index.parent}: re-download it or remove it")
        shard_of[name] = index.parent / shard
    return shard_of


@contextmanager
def open_shard(shard: Path) -> Iterator[Any]:
    """``safe_open`` of one shard; a damaged or foreign file raises ``ValueError`` naming it."""
    from safetensors import safe_open

    try:
        handle = safe_open(shard, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError subclasses)
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{shard} is not a readable safetensors file ({' '.join(str(exc).split())}): "
                         "re-download or remove the shard") from None
    with handle as f:
        yield f


def pick(tensors: dict[str, str], candidates: tuple[str, ...]) -> str | None:
    """The full name of the first of ``candidates`` present in a layer's ``tensors``, else None."""
    for candidate in candidates:
        if candidate in tensors:
            return tensors[candidate]
    return None


def missing_message(candidates: tuple[str, ...], what: str, layer_id: int) -> str:
    """An error naming a missing Engram tensor and every name that was tried."""
    tried = ", ".join(f"layers.{layer_id}.engram.{c}" for c in candidates)
    return f"layer {layer_id} has no {what}: tried {tried}"
