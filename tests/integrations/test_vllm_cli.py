"""vLLM's own command line, parsed into the ``VllmConfig`` the plugin reads.

Each command is parsed as ``vllm serve`` parses it: vLLM's ``FlexibleArgumentParser`` through
``make_arg_parser`` (what the serve subcommand's ``subparser_init`` calls: the model
positional, the server's options and ``EngineArgs.add_cli_args``'s), then
``EngineArgs.from_cli_args`` (as ``AsyncEngineArgs``, as serve does) and
``create_engine_config``, the model being a local folder with DeepSeek-V4.1-Flash's
``config.json`` (nothing is downloaded; its ``quantization_config`` is left out: vLLM's check
of it imports ``compressed_tensors``, absent from the CPU set-up, and the plugin reads none of
it). The plugin then reads that config under ``set_current_vllm_config``
(``settings_from_vllm``, ``_full_graphs``) and ``check_graph_mode`` decides. The commands are
the cases below and every ``vllm serve`` command of docs/serving.md.

vLLM runs in a subprocess (this file as a script) with ``CUDA_VISIBLE_DEVICES=""`` and
``VLLM_TARGET_DEVICE=cpu``, vLLM's CPU platform: without a platform the parser cannot even
build its device default. Where vLLM's path stops on a CPU: ``VllmConfig.__post_init__`` keeps
a CUDA-graph mode only on a platform whose ``support_static_graph_mode()`` is true (CUDA's);
on any other it sets ``cudagraph_mode = NONE`` whatever the command says. So here the CPU
platform answers true, as CUDA's does, and the rest of ``__post_init__`` resolves the mode as
on a GPU (the -O level's default, ``-cc``, ``--enforce-eager``; the CPU platform's own
compilation-mode change would matter only without breakable CUDA graphs, which vLLM turns on
for DeepSeek-V4.1 itself).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engram_offload.integrations.settings import AUTO, parse_settings
from engram_offload.integrations.vllm import GRAPH_FIX

try:
    VLLM = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    VLLM = None

pytestmark = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed (make engines installs it on a CPU)")

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "serving.md"
V41_CONFIG = ROOT / "tests" / "data" / "deepseek-v4.1-flash-config.json"
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
DIRECT = {"table": "/nvme/engram/v41f.table", "tier": "direct", "cache_bytes": "32GiB"}
REFUSED = "the direct tier reads rows on the host, which a FULL CUDA graph cannot replay: "
RUN_TIMEOUT_S = 600

# name -> (flags after `vllm serve MODEL -tp 4 --additional-config ...`, the CUDA-graph mode vLLM
# resolves, whether the plugin accepts the direct tier under it)
CASES = {
    "default (-O2)": ([], "FULL_AND_PIECEWISE", False),
    "--enforce-eager": (["--enforce-eager"], "NONE", True),
    "-cc.cudagraph_mode=PIECEWISE": (["-cc.cudagraph_mode=PIECEWISE"], "PIECEWISE", True),
    "--compilation-config PIECEWISE": (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'], "PIECEWISE", True),
    "-cc.cudagraph_mode=FULL": (["-cc.cudagraph_mode=FULL"], "FULL", False),
    "-cc.cudagraph_mode=FULL_DECODE_ONLY": (["-cc.cudagraph_mode=FULL_DECODE_ONLY"], "FULL_DECODE_ONLY", False),
    "-O0": (["-O0"], "NONE", True),
    "-O1": (["-O1"], "PIECEWISE", True),
    "-O 1": (["-O", "1"], "PIECEWISE", True),
    "-O2": (["-O2"], "FULL_AND_PIECEWISE", False),
    "-O3": (["-O3"], "FULL_AND_PIECEWISE", False),
    "-O3 --enforce-eager": (["-O3", "--enforce-eager"], "NONE", True),
    "-O3 -cc.cudagraph_mode=PIECEWISE": (["-O3", "-cc.cudagraph_mode=PIECEWISE"], "PIECEWISE", True),
}


def case_argv(flags: list[str], settings: dict | None = None, **extra) -> list[str]:
    config = {"engram_offload": settings or DIRECT, **extra}
    return [MODEL, "-tp", "4", "--additional-config", json.dumps(config), *flags]


def serve_commands(text: str) -> list[tuple[dict, list[str]]]:
    """Every ``vllm serve`` command of ``text``'s fenced code blocks as (environment, argv after
    ``vllm serve``): a line starting with ``vllm serve`` (after a ``$ `` prompt and ``NAME=value``
    assignments), joined with its ``\\`` continuations and the lines of a quote it leaves open."""
    commands = []
    for block in re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, re.M | re.S):
        current = None
        for line in re.sub(r"\\\n", " ", block).split("\n"):
            if current is None:
                line = line.strip().removeprefix("$ ")
                if not re.match(r"(?:[A-Za-z_]\w*=\S*\s+)*vllm\s+serve\b", line):
                    continue
            current = line if current is None else f"{current}\n{line}"
            try:
                words = shlex.split(current)
            except ValueError:  # a quote still open: the command goes on
                continue
            current = None
            at = words.index("vllm")
            commands.append((dict(w.split("=", 1) for w in words[:at]), words[at + 2:]))
        assert current is None, f"a vllm serve command in {GUIDE.name} never closes its quote: {current}"
    return commands


GUIDE_COMMANDS = serve_commands(GUIDE.read_text())


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """Every command's config, as vLLM builds it and the plugin reads it (one vLLM subprocess)."""
    folder = tmp_path_factory.mktemp("vllm-cli")
    model = folder / "DeepSeek-V4.1-Flash"
    model.mkdir()
    config = json.loads(V41_CONFIG.read_text())
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))
    commands = {name: ({}, case_argv(flags)) for name, (flags, _, _) in CASES.items()}
    commands["pinned, default"] = ({}, case_argv([], {"table": DIRECT["table"], "tier": "pinned"}))
    commands["specialized decode"] = ({}, case_argv(["-cc.cudagraph_mode=PIECEWISE"],
                                                     decode_backend="latency_specialized"))
    commands["no settings"] = ({}, [MODEL, "-tp", "4"])
    commands["piecewise, breakable graphs off"] = ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"},
                                                   case_argv(["-cc.cudagraph_mode=PIECEWISE"]))
    commands.update({f"guide {i}": command for i, command in enumerate(GUIDE_COMMANDS)})
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "commands": commands}))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S, cwd=folder)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def read(parsed, name):
    result = parsed[name]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("name", CASES)
def test_the_graph_mode_vllm_parses_decides_a_host_read_tier(parsed, name):
    flags, mode, accepted = CASES[name]
    result = read(parsed, name)
    assert (result["model_tag"], result["tp"]) == (MODEL, 4)
    assert result["additional_config"] == {"engram_offload": DIRECT}
    assert result["settings"] == dataclasses.asdict(parse_settings(DIRECT))  # settings_from_vllm's
    assert (result["cudagraph_mode"], result["enforce_eager"]) == (mode, "--enforce-eager" in flags)
    assert result["full_graphs"] == (not accepted)
    if accepted:
        assert result["decision"] == "accepted"
    else:
        assert result["decision"].startswith(REFUSED + GRAPH_FIX), result["decision"]


def test_an_in_place_tier_a_specialized_decode_and_no_settings(parsed):
    pinned, special, bare = (read(parsed, n) for n in ("pinned, default", "specialized decode", "no settings"))
    assert pinned["full_graphs"] and pinned["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert pinned["decision"] == "accepted"  # the GPU reads the table in place: every graph mode
    assert special["cudagraph_mode"] == "PIECEWISE" and special["full_graphs"]  # its decode replays FULL graphs
    assert special["decision"].startswith(REFUSED)
    assert bare["settings"] is None and bare["additional_config"] == {} and bare["tp"] == 4


def test_without_vllms_breakable_graphs_v41_runs_without_graphs_so_a_host_read_runs(parsed):
    """vLLM's breakable graphs are what run ``_finish_prefetch`` eagerly between piecewise graphs;
    turned off, vLLM runs DeepSeek-V4.1 (which it cannot torch.compile) with no CUDA graphs."""
    result = read(parsed, "piecewise, breakable graphs off")
    assert result["cudagraph_mode"] == "NONE" and not result["full_graphs"]
    assert result["decision"] == "accepted"


def test_the_guide_has_vllm_serve_commands():
    assert GUIDE_COMMANDS, f"no `vllm serve` command found in {GUIDE}"


@pytest.mark.parametrize("index", range(len(GUIDE_COMMANDS)))
def test_every_vllm_serve_command_of_the_guide_parses_and_starts(parsed, index):
    result = read(parsed, f"guide {index}")
    raw = result["additional_config"]["engram_offload"]
    assert result["settings"] == dataclasses.asdict(parse_settings(raw))
    if raw["tier"] != AUTO:  # auto is resolved at start-up from the machine (its table's disk, its DRAM)
        assert result["decision"] == "accepted", result["decision"]  # the plugin would start with it


def resolve(spec: dict) -> dict:
    """Run in the subprocess: each command through vLLM's parser and config, read by the plugin."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import engram_offload.integrations.vllm as plugin
    from engram_offload.integrations.settings import check_graph_mode

    type(current_platform).support_static_graph_mode = classmethod(lambda cls: True)  # as CUDA's (docstring)
    parser = make_arg_parser(FlexibleArgumentParser())
    out = {}
    for name, (env, argv) in spec["commands"].items():
        before = dict(os.environ)
        os.environ.update(env)
        try:
            args = parser.parse_args(argv)
            model_tag, args.model = args.model_tag, spec["model"]  # serve takes the positional as the model
            config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
            with set_current_vllm_config(config):
                settings, full = plugin.settings_from_vllm(), plugin._full_graphs()
            try:
                if settings is not None:
                    check_graph_mode(settings, full, plugin.GRAPH_FIX)
                decision = "accepted"
            except ValueError as exc:
                decision = str(exc)
            out[name] = {
                "model_tag": model_tag, "tp": config.parallel_config.tensor_parallel_size,
                "enforce_eager": config.model_config.enforce_eager,
                "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
                "additional_config": config.additional_config, "full_graphs": full, "decision": decision,
                "settings": None if settings is None else dataclasses.asdict(settings)}
        except Exception as exc:  # the test names the command that failed and why
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            os.environ.clear()
            os.environ.update(before)
    return out


if __name__ == "__main__":
    print(json.dumps(resolve(json.loads(Path(sys.argv[1]).read_text()))))
