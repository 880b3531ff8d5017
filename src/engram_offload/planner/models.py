"""Model descriptions for the planner: the Engram layout plus the backbone facts that size it.

A ``ModelSpec`` pairs an ``EngramConfig`` (the table) with what the backbone needs from
HBM and compute: parameters by precision group, active parameters in prefill and decode,
KV-cache bytes per token, layer count and the first Engram layer (which bounds the
prefetch window). Each preset's facts carry their source; every assumption says so.
Sources are also tabulated in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..engram.config import EngramConfig
from ..table.safeio import parse_json, read_input

__all__ = ["PRECISION_BYTES", "WeightGroup", "ModelSpec", "MODELS", "get_model", "custom_model"]

# Bytes per stored weight, scale overhead included.
PRECISION_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    # float8_e4m3fn with one fp32 scale per 128x128 block (DeepSeek-V3/V4 checkpoints).
    "fp8": 1.0 + 4.0 / (128 * 128),
    # float4 e2m1 with one ue8m0 byte scale per 32 values (MXFP4, OCP MX spec v1.0).
    "fp4": 0.5 + 1.0 / 32,
    "int8": 1.0,
}


def precision_bytes(name: str) -> float:
    try:
        return PRECISION_BYTES[name]
    except KeyError:
        raise ValueError(
            f"unknown weight precision {name!r}; choose one of: {', '.join(PRECISION_BYTES)}"
        ) from None


@dataclass(frozen=True)
class WeightGroup:
    """Parameters stored at one precision; ``routed`` marks routed-expert weights."""

    name: str
    params: float
    precision: str
    routed: bool = False

    @property
    def bytes(self) -> float:
        return self.params * precision_bytes(self.precision)


@dataclass(frozen=True)
class ModelSpec:
    """An Engram model as the planner sees it (the backbone excludes the Engram table)."""

    name: str
    engram: EngramConfig
    weights: tuple[WeightGroup, ...]
    active_params_prefill: float
    active_params_decode: float
    num_layers: int
    kv_bytes_per_token: float
    hidden_size: int
    kv_replicated_across_tp: bool = True
    num_experts: int = 0
    experts_per_token: int = 0
    compute_precision: str = "fp8"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.first_engram_layer >= self.num_layers:
            raise ValueError(
                f"{self.name}: first Engram layer {self.first_engram_layer} is not below the "
                f"layer count {self.num_layers}; check --layers"
            )
        if self.active_params_decode <= 0 or self.active_params_prefill <= 0:
            raise ValueError(f"{self.name}: active parameters must be positive")

    @property
    def total_params(self) -> float:
        """Backbone parameters (the Engram table not included)."""
        return sum(g.params for g in self.weights)

    @property
    def weight_bytes(self) -> float:
        return sum(g.bytes for g in self.weights)

    @property
    def routed_bytes(self) -> float:
        return sum(g.bytes for g in self.weights if g.routed)

    @property
    def first_engram_layer(self) -> int:
        return min(self.engram.layer_ids)

    def weight_bytes_touched(self, batch: int) -> float:
        """Weight bytes one decode step reads at ``batch`` tokens: dense weights plus the
        expected share of routed experts some token selects, ``1 - (1 - k/E)^batch``."""
        if not self.num_experts:
            return self.weight_bytes
        frac = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(batch, 0)
        return self.weight_bytes - self.routed_bytes * (1.0 - frac)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backbone_params": self.total_params,
            "weight_bytes": self.weight_bytes,
            "weights": [
                {"name": g.name, "params": g.params, "precision": g.precision,
                 "bytes_per_weight": precision_bytes(g.precision)} for g in self.weights
            ],
            "active_params_prefill": self.active_params_prefill,
            "active_params_decode": self.active_params_decode,
            "num_layers": self.num_layers,
            "first_engram_layer": self.first_engram_layer,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_replicated_across_tp": self.kv_replicated_across_tp,
            "notes": list(self.notes),
        }


# ----------------------------------------------------------------- DeepSeek-V4.1-Flash
# Backbone 552B MoE, 8B active in prefill and 16B in decode; Engram adds a table of
# 196.6B parameters (748B in all); KV cache one quarter of its predecessor's:
#   DeepSeek-V4.1-Flash release as reported by SemiAnalysis (InferenceX, Sep 18) and
#   the article "DeepSeek Engram Offloading Moves AI Memory Beyond HBM" (Sep 19).
# Precision: the V4 family ships routed experts in FP4 (e2m1, ue8m0 scale per 32) and the
#   other weights in FP8 (e4m3, 128x128 block scales): DeepSeek-V4 model card
#   (huggingface.co/deepseek-ai/DeepSeek-V4-Flash, "FP4 + FP8 mixed"); the
#   DeepSeek-V4-Flash-FP4-FP8 packages on Hugging Face list routed experts as MXFP4 and
#   dense/shared tensors as FP8 e4m3 B128. Assumed unchanged in V4.1.
# Geometry: the released V4.1-Flash config.json (text_config): 40 layers
#   (num_hidden_layers), hidden 5,120 (hidden_size, as in the "deepseek-v4.1-flash" Engram
#   preset), 384 routed experts (n_routed_experts) of which 6 a token (num_experts_per_tok),
#   each three matrices of 5,120 x 2,304 (moe_intermediate_size).
# Routed parameters: every layer MoE, as in V4-Flash (ASSUMED):
#   40 * 384 * 3 * 5,120 * 2,304 = 543.6B of the 552B; the other 8.4B are attention, shared
#   experts and router (FP8) and the bf16 embedding and head, 2 * 129,280 * 5,120 = 1.32B.
# KV bytes per token: V4-Pro holds 1M tokens in 9.62 GiB (bf16, 61 layers; DeepSeek-V4
#   report) = 161.5 B/token/layer; its predecessor V4-Flash (43 layers) 6,944 B/token; V4.1
#   "one quarter" of that -> 1,736. One latent KV head (num_key_value_heads = 1), so every
#   TP rank keeps the whole cache.
_V41_LAYERS, _V41_EXPERTS, _V41_TOP_K, _V41_MOE_INTERMEDIATE = 40, 384, 6, 2304
_V41_ENGRAM = EngramConfig.from_name("deepseek-v4.1-flash")
_V41_ROUTED = _V41_LAYERS * _V41_EXPERTS * 3 * _V41_ENGRAM.hidden_size * _V41_MOE_INTERMEDIATE
_V41_EMBED = 2 * 129_280 * _V41_ENGRAM.hidden_size

MODELS: dict[str, ModelSpec] = {
    "deepseek-v4.1-flash": ModelSpec(
        name="deepseek-v4.1-flash",
        engram=_V41_ENGRAM,
        weights=(
            WeightGroup("routed experts", _V41_ROUTED, "fp4", routed=True),
            WeightGroup("attention, shared experts, router", 552e9 - _V41_ROUTED - _V41_EMBED, "fp8"),
            WeightGroup("embedding and head", _V41_EMBED, "bf16"),
        ),
        active_params_prefill=8e9,
        active_params_decode=16e9,
        num_layers=_V41_LAYERS,
        kv_bytes_per_token=9.62 * 2**30 / 2**20 / 61 * 43 / 4,
        hidden_size=_V41_ENGRAM.hidden_size,
        kv_replicated_across_tp=True,
        num_experts=_V41_EXPERTS,
        experts_per_token=_V41_TOP_K,
        compute_precision="fp8",
        notes=(
            "routed experts FP4 (e2m1 + ue8m0/32), other weights FP8 (e4m3, 128x128 scales): V4 model card",
            "40 layers, 384 routed experts top-6 of 3 x 5,120 x 2,304: released config.json; every layer MoE: assumed",
            "KV 1,736 B/token: V4-Pro 9.62 GiB per 1M tokens scaled to V4-Flash's 43 layers, then / 4 (V4.1 claim)",
        ),
    ),
}

# ----------------------------------------------------------------- Engram paper models
# "Conditional Memory via Scalable Lookup" (DeepSeek, arXiv 2601.07372): Engram-27B has
# 26.7B parameters with 5.7B in Engram, Engram-40B 39.5B with 18.5B in Engram, both on the
# same MoE backbone (routed experts cut from 72 to 55, top-6, 2 shared) with 3.8B active.
# The backbone is therefore ~21.0B for both. 30 layers, Engram at layers 2 and 15 (paper).
# bf16 weights and an MLA cache of 512 + 64 bf16 values per layer per token (34,560 B) are
# ASSUMED (research checkpoints; not stated as serving formats in the paper).
for _name, _total in (("engram-27b", 26.7e9), ("engram-40b", 39.5e9)):
    _cfg = EngramConfig.from_name(_name)
    _backbone = _total - _cfg.num_rows * _cfg.head_dim
    MODELS[_name] = ModelSpec(
        name=_name,
        engram=_cfg,
        weights=(
            WeightGroup("routed experts", _backbone * 0.8, "bf16", routed=True),
            WeightGroup("attention, shared experts, embeddings", _backbone * 0.2, "bf16"),
        ),
        active_params_prefill=3.8e9,
        active_params_decode=3.8e9,
        num_layers=30,
        kv_bytes_per_token=30 * (512 + 64) * 2,
        hidden_size=_cfg.hidden_size,
        kv_replicated_across_tp=True,
        num_experts=55,
        experts_per_token=6,
        compute_precision="bf16",
        notes=(
            "totals and 3.8B active from the Engram paper (arXiv 2601.07372)",
            "bf16 weights, 80% routed share, MLA KV 34,560 B/token and 30 layers: assumed",
        ),
    )


def get_model(name: str) -> ModelSpec:
    """A preset model; the error lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)}, "
            "or describe your own with --config config.json and the backbone flags"
        ) from None


def _model_name(data: Mapping[str, Any], path: Path) -> str:
    """A custom model's name: the config's ``_name_or_path``, else the file's stem (its
    folder's name for a ``config.json``: a checkpoint folder), with its architecture."""
    given = data.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return Path(given.strip()).name
    name = path.parent.resolve().name if path.stem == "config" else path.stem
    arch = data.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return f"{name} ({arch[0]})" if name else arch[0]
    return name or "custom"


def custom_model(
    config: str | Path | Mapping[str, Any],
    *,
    total_params: float | None = None,
    active_params_prefill: float | None = None,
    active_params_decode: float | None = None,
    precision: str = "fp8",
    expert_precision: str | None = None,
    routed_fraction: float | None = None,
    kv_bytes_per_token: float | None = None,
    num_layers: int | None = None,
    name: str | None = None,
) -> ModelSpec:
    """A model from a Hugging Face ``config.json`` (Engram fields and layer/expert counts)
    plus backbone facts a config does not state (parameter counts, KV bytes per token)."""
    data: dict[str, Any]
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            data = parse_json(read_input(path, "config.json"), str(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: give a config.json")
        name = name or _model_name(data, path)
    else:
        data = dict(config)
    text_config = data.get("text_config")
    text: Mapping[str, Any] = text_config if isinstance(text_config, Mapping) else data
    engram = EngramConfig.from_hf_config(data)
    missing = [flag for flag, v in (("--total-params", total_params),
                                    ("--active-params", active_params_decode)) if v is None]
    if kv_bytes_per_token is None:
        missing.append("--kv-bytes-per-token")
    if missing:
        raise ValueError(
            f"a custom model needs {', '.join(missing)} (config.json does not state them), "
            "e.g. --total-params 552e9 --active-params 16e9 --kv-bytes-per-token 1736"
        )
    assert total_params is not None and active_params_decode is not None  # in `missing` otherwise
    assert kv_bytes_per_token is not None
    layers = int(num_layers or text.get("num_hidden_layers", 0))
    if layers <= 0:
        raise ValueError("config.json lacks num_hidden_layers; pass --layers")
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 0)
    top_k = int(text.get("num_experts_per_tok") or 0)
    if routed_fraction is None:
        if not experts and expert_precision and expert_precision != precision:
            raise ValueError(
                f"config.json names no routed experts (n_routed_experts), so --expert-precision {expert_precision} "
                "would apply to nothing: give --routed-fraction, the share of --total-params in routed experts "
                "(e.g. 0.985 for DeepSeek-V4.1-Flash)"
            )
        routed_fraction = 0.95 if experts else 0.0
    routed = total_params * routed_fraction
    groups = [WeightGroup("non-routed", total_params - routed, precision)]
    if routed:
        groups.insert(0, WeightGroup("routed experts", routed, expert_precision or precision, routed=True))
    return ModelSpec(
        name=name or "custom",
        engram=engram,
        weights=tuple(groups),
        active_params_prefill=float(active_params_prefill or active_params_decode),
        active_params_decode=float(active_params_decode),
        num_layers=layers,
        kv_bytes_per_token=float(kv_bytes_per_token),
        hidden_size=int(text.get("hidden_size", engram.hidden_size)),
        num_experts=experts,
        experts_per_token=top_k,
        compute_precision="fp8" if precision in ("fp8", "fp4") else "bf16",
        notes=("custom model: backbone facts from flags",),
    )
