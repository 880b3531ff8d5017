"""SGLang's command line decides whether the plugin serves a tier: its own parser, real flags.

The server args come from SGLang 0.5.23's parser (``prepare_server_args``) and its resolution,
published as its scheduler publishes them, against a local model directory holding only a
DeepSeek-V4.1 ``config.json`` (nothing is downloaded; ``--device cuda`` stands for the GPU this
machine lacks). With ``ENGRAM_OFFLOAD_CONFIG`` set, the first Engram layer refuses a host-read
tier in one line while SGLang captures CUDA graphs in either phase (decode graphs are its
default) and builds once both phases' graphs are off (the flags, or the deprecated
``--disable-cuda-graph``); the in-place tiers build with graphs on. Every SGLang launch line of
docs/serving.md parses with SGLang's parser, and its tier's graph decision lets it start.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from engram_offload.integrations import sglang as plugin
from engram_offload.integrations.settings import check_graph_mode, settings_from_json

from engram_tables import same_bits, v41_config, write_v41_table
from test_sglang_engine import (NO_GRAPHS, SGLANG, build_engram, layer_ids_of, plugin_loaded, served, server_args,
                                sglang_modules, write_model_dir)

pytestmark = pytest.mark.skipif(SGLANG not in plugin.TESTED_VERSIONS,
                                reason=f"SGLang {plugin.TESTED_VERSIONS[0]} is not installed here "
                                       "(make test-sglang runs these tests beside it)")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
CONFIG = v41_config()
REFUSED = ("reads rows on the host, which a FULL CUDA graph cannot replay: start SGLang with "
           "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled, or use a tier the GPU reads "
           "in place (memory, pinned, shared)")


@pytest.fixture(scope="module")
def sglang():
    return sglang_modules()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "DeepSeek-V4.1-Flash")


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("sglang-args") / "v41.table", CONFIG, seed=4)


@pytest.mark.parametrize("flags", [(), ("--cuda-graph-backend-prefill=disabled",),
                                   ("--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=breakable")],
                         ids=["default", "decode-graphs", "prefill-graphs"])
@pytest.mark.parametrize("tier", ["mmap", "direct", "row_server"])
def test_a_host_read_tier_under_sglangs_graphs_stops_the_first_layer_in_one_line(sglang, model_dir, table,
                                                                                 monkeypatch, tier, flags):
    path, raw = table
    settings = {"table": str(path), "tier": "mmap", "row_server": "/run/engram/rows.sock"} if tier == "row_server" \
        else {"table": str(path), "tier": tier}
    with served(model_dir, *flags), plugin_loaded(sglang, monkeypatch, settings):
        with pytest.raises(ValueError) as refused:
            build_engram(sglang, 1, raw)
        assert plugin._stores == {}  # refused before a store is opened
    where = "the row server at /run/engram/rows.sock" if tier == "row_server" else f"the {tier} tier"
    assert str(refused.value) == f"{where} {REFUSED}"


def test_without_sglangs_server_args_graphs_are_assumed(sglang, table, monkeypatch):
    """Before SGLang publishes its server args the plugin cannot know: it refuses a host read."""
    path, raw = table
    with plugin_loaded(sglang, monkeypatch, {"table": str(path), "tier": "mmap"}):
        with pytest.raises(ValueError, match="FULL CUDA graph"):
            build_engram(sglang, 1, raw)


@pytest.mark.parametrize("flags", [NO_GRAPHS, ("--disable-cuda-graph",)], ids=["backends-disabled", "deprecated"])
def test_a_host_read_tier_serves_with_sglangs_graphs_off(sglang, model_dir, table, monkeypatch, flags):
    path, raw = table
    ids = layer_ids_of(1, seed=2)
    with served(model_dir, *flags) as args:
        assert args.disable_cuda_graph == (flags == ("--disable-cuda-graph",))  # what 0.5.23 maps it to: both off
        own = build_engram(sglang, 1, raw).embed(ids)
        with plugin_loaded(sglang, monkeypatch, {"table": str(path), "tier": "mmap"}):
            assert same_bits(build_engram(sglang, 1, raw).embed(ids), own)


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_an_in_place_tier_serves_under_sglangs_default_graphs(sglang, model_dir, table, monkeypatch, tier):
    path, raw = table
    ids = layer_ids_of(14, seed=3)
    with served(model_dir):
        own = build_engram(sglang, 14, raw).embed(ids)
        with plugin_loaded(sglang, monkeypatch, {"table": str(path), "tier": tier}):
            embed = build_engram(sglang, 14, raw).embed
            assert embed.engram_offload.table is not None  # gathered by the device from the resident rows
            assert same_bits(embed(ids), own)


def launch_lines(text: str) -> list[tuple[dict[str, str], str, list[str]]]:
    """The SGLang launch commands of a Markdown text's code blocks (``python -m
    sglang.launch_server ...`` or ``sglang serve ...``, ``\\`` continuations and quoted strings
    over several lines joined; in a block with ``$ `` prompts, only the prompted commands): each
    one's environment assignments, entry point and arguments."""
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        prompted = re.search(r"^\$ ", block, re.M) is not None
        pending = ""
        for line in re.sub(r"\\\n", " ", block).split("\n"):
            if not pending and prompted and not line.startswith("$ "):
                continue  # a command's output
            pending = f"{pending}\n{line}" if pending else line
            try:
                words = shlex.split(pending.removeprefix("$ "), comments=True)
            except ValueError:  # a quoted string goes on on the next line
                continue
            pending = ""
            for i, word in enumerate(words):
                if word in ("python", "python3") and words[i + 1:i + 3] == ["-m", "sglang.launch_server"]:
                    entry, argv = "launch_server", words[i + 3:]
                elif word.rsplit("/", 1)[-1] == "sglang" and words[i + 1:i + 2] == ["serve"]:
                    entry, argv = "serve", words[i + 2:]
                else:
                    continue
                ends = [k for k, w in enumerate(argv) if w in ("&&", "||", ";", "|", "&") or w.startswith(">")]
                env = dict(w.split("=", 1) for w in words[:i] if re.match(r"^[A-Z_][A-Z0-9_]*=", w))
                found.append((env, entry, argv[:ends[0]] if ends else argv))
                break
    return found


def test_launch_lines_are_found_however_the_guide_writes_them():
    text = ("```console\n$ ENGRAM_OFFLOAD_CONFIG='{\"table\": \"/t\",\n    \"tier\": \"mmap\"}' \\\n"
            "    python -m sglang.launch_server --model-path M --tp 4 &  # the rank's\nit's up: sglang serve X\n```\n"
            "```\nsglang serve M --tp 2 && echo\n```\n```python\nprint('sglang')\n```\n")
    assert launch_lines(text) == [({"ENGRAM_OFFLOAD_CONFIG": '{"table": "/t",\n    "tier": "mmap"}'}, "launch_server",
                                   ["--model-path", "M", "--tp", "4"]),
                                  ({}, "serve", ["M", "--tp", "2"])]


def test_every_sglang_launch_line_of_the_guide_parses_and_starts(sglang, model_dir, monkeypatch):
    """SGLang's parser takes each line's flags (``sglang serve``'s positional model and
    ``--model-type`` as that command takes them); resolved against the local model directory (the
    guide's model path replaced), its graph settings pass the plugin's check for the line's
    settings."""
    from sglang.cli.serve import _extract_model_type_override, _normalize_positional_model_path
    from sglang.srt.runtime_context import create_context, use_context

    lines = launch_lines(GUIDE.read_text())
    if not lines:
        pytest.skip("docs/serving.md has no SGLang launch line (python -m sglang.launch_server or sglang serve)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for env, entry, argv in lines:
        if entry == "serve":
            argv = _normalize_positional_model_path(_extract_model_type_override(argv)[1])[0]
        model = server_args(argv).model_path  # SGLang's parser: a flag it does not take exits
        argv = [str(model_dir) if a == model else a.replace(f"={model}", f"={model_dir}") for a in argv]
        device = [] if any(a == "--device" or a.startswith("--device=") for a in argv) else ["--device", "cuda"]
        args = server_args([*argv, *device])
        args.resolve_once()
        if plugin.ENV in env:
            settings = settings_from_json(env[plugin.ENV], plugin.ENV)
            with use_context(create_context(args, role="scheduler")):
                check_graph_mode(settings, plugin.captures_graphs(), plugin.GRAPH_FIX)
