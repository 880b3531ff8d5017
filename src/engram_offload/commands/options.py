"""Options several sub-commands share, spelled and documented alike, and the refusal of
removed spellings.

One spelling per concept: ``--preset NAME`` (a named model), ``--checkpoint DIR`` (a trained
model's folder), ``--cache-bytes`` (a DRAM row cache), ``--policy`` (its eviction policy,
default lfu), ``--json`` (a switch: print JSON), ``--json-out PATH`` (write JSON to a file),
``--pool URL`` and ``--pool-nodes N``. A removed spelling is refused with the new name.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..cache.policy import DEFAULT_POLICY, POLICIES
from ..units import size_arg, size_or_percent_arg

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_CHOICES",
    "add_cache_bytes",
    "add_json",
    "add_json_out",
    "add_policy",
    "add_pool",
    "add_pool_nodes",
    "gpu_arg",
    "local_tier_arg",
    "model_preset_arg",
    "preset_arg",
    "removed_option",
]

POLICY_CHOICES = tuple(POLICIES)


class _Removed(argparse.Action):
    """An option spelling that was removed: a usage error naming its replacement, or why it went."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", why: str = "", **kwargs: Any) -> None:
        self.new, self.why = new, why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was removed: {self.why}" if self.why else
                     f"{option_string} was removed; use {self.new}")


def removed_option(parser: Any, old: str, new: str = "", *, why: str = "") -> None:
    """Refuse ``old`` (hidden from the help) with a usage error naming ``new`` (or, with no
    replacement, saying ``why`` it went), exit code 2; an exact spelling, so argparse never
    reads it as an abbreviation of another option."""
    parser.add_argument(old, action=_Removed, new=new, why=why, nargs="?", dest=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _name_arg(names: Callable[[], Any], what: str, normalize: Callable[[str], str] = lambda s: s
              ) -> Callable[[str], str]:
    """argparse type: one of ``names()`` (read when parsing), else a usage error listing them."""

    def parse(text: str) -> str:
        known = list(names())
        if normalize(text) not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose one of: {', '.join(known)}")
        return text

    parse.__name__ = what
    return parse


def _presets() -> Any:
    from ..engram.config import PRESETS

    return PRESETS


def _models() -> Any:
    from ..planner.models import MODELS

    return MODELS


def _gpus() -> Any:
    from ..planner.hardware import GPUS

    return GPUS


preset_arg = _name_arg(_presets, "preset")
model_preset_arg = _name_arg(_models, "model preset")
gpu_arg = _name_arg(_gpus, "GPU", lambda s: s.strip().lower().replace(" ", "").replace("-", ""))


def local_tier_arg(placements: bool) -> Callable[[str], str]:
    """argparse type: a tier that reads this machine's table file, or (``placements``) a placement
    of such tiers (``1=memory/14=direct``); else a usage error naming the choices."""
    from ..tiers import TIERS, tier_names

    local = ", ".join(tier_names(local=True))

    def parse(text: str) -> str:
        from ..serving.layered import parse_placement

        if "=" in text and not placements:
            raise argparse.ArgumentTypeError(f"{text!r} is a placement; this command reads every layer from one tier: "
                                             f"give one of {local}")
        try:
            names = set(parse_placement(text).values()) if "=" in text else {text}
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        for name in sorted(names):
            if name in TIERS and name not in tier_names(local=True):
                raise argparse.ArgumentTypeError(f"the {name} tier reads a Redis pool, not the table file: give one "
                                                 f"of {local} (bench --tiers remote measures a pool)")
            if name not in TIERS:
                raise argparse.ArgumentTypeError(f"unknown tier {name!r}; choose one of: {local}"
                                                 + (", or a placement such as 1=memory/14=direct" if placements else ""))
        return text

    parse.__name__ = "tier"
    return parse


def add_json(parser: Any) -> argparse.Action:
    """``--json``: a switch, the result printed as JSON on stdout instead of text."""
    return parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")


def add_json_out(parser: Any, default: str = "none") -> argparse.Action:
    """``--json-out PATH``: the result written as JSON to a file."""
    return parser.add_argument("--json-out", metavar="PATH", help=f"write the result as JSON to PATH (default {default})")


def add_cache_bytes(parser: Any, default: str | int | None = "0", percent: bool = True,
                    what: str = "DRAM row cache in front of the tier", shown: str | None = None) -> argparse.Action:
    """``--cache-bytes SIZE``: a DRAM row cache (0: none); ``percent``: of the table allowed."""
    unit = "bytes, 512M, 2G" + (" or a percentage of the table (10%%)" if percent else "")
    shown = shown or (f"{default:,}" if isinstance(default, int) else str(default))
    return parser.add_argument("--cache-bytes", default=default, metavar="SIZE",
                               type=size_or_percent_arg if percent else size_arg,
                               help=f"{what}: {unit} (default {shown}; 0 = none)")


def add_policy(parser: Any) -> argparse.Action:
    """``--policy``: the row cache's eviction policy."""
    return parser.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICY_CHOICES,
                               help=f"row cache eviction policy (default {DEFAULT_POLICY})")


def add_pool(parser: Any, default: str | None, what: str) -> argparse.Action:
    """``--pool URL``: the Redis pool's nodes."""
    return parser.add_argument("--pool", default=default, metavar="URL",
                               help=f"the pool's nodes, redis://host:port[,host:port...] (default {what})")


def add_pool_nodes(parser: Any, default: int, what: str) -> argparse.Action:
    """``--pool-nodes N``: servers of a loopback pool started here."""
    from ..units import positive_int

    return parser.add_argument("--pool-nodes", type=positive_int, default=default, metavar="N",
                               help=f"servers of the loopback pool started here (default {default}{what})")
