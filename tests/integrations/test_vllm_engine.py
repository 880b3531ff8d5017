"""vLLM's own Engram code (0.33.0 and 0.34.0), on a CPU, through the installed plugin (``vllm_driver.py``).

Each run is a subprocess with ``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` set before
vLLM is imported; vLLM's own kernels (its lookup and hash kernels, under Triton's interpreter)
are the oracles. Skipped where vLLM is not installed (``make engines`` installs 0.33.0 in .venv,
``make engines-vllm034`` 0.34.0 in .venv-vllm034).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from engram_offload.integrations.vllm import TESTED_VERSIONS

from engram_tables import SOCKET, served_tables, v41_config

try:
    VLLM = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    VLLM = None

pytestmark = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed (make engines installs 0.33.0 on a CPU)")
DRIVER = Path(__file__).with_name("vllm_driver.py")
CONFIG = v41_config()
WORLD = 4
RUN_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_driver(mode: str, spec: dict, folder: Path, name: str) -> subprocess.Popen:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", VLLM_PLUGINS="engram_offload")
    return subprocess.Popen([sys.executable, str(DRIVER), mode, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(folder))


def results(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, f"the vLLM driver failed:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@contextmanager
def engine_files(folder: Path):
    """The drivers' spec over one V4.1 table in ``folder`` (memory, direct + cache, a row server
    on the mmap tier and a Redis pool where redis-server runs, stopped on exit) and another model's table."""
    with served_tables(folder, seed=3, socket_prefix="vl-") as files:
        yield {"table": str(files.table), "other_table": str(files.other), "socket": str(files.socket),
               "server_tier": files.server_tier, "tokens": 3, "pool_table": files.pool_table}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The checks at TP 1 and ranks 0..3 of a TP-4 gloo group, run concurrently, over one table."""
    assert VLLM in TESTED_VERSIONS, f"vLLM {VLLM} is installed; the plugin is tested with {TESTED_VERSIONS}"
    folder = tmp_path_factory.mktemp("vllm")
    with engine_files(folder) as spec:
        port = free_port()
        ranks = [run_driver("rank", dict(spec, rank=r, world=WORLD, port=port), folder, f"rank{r}")
                 for r in range(WORLD)]
        single = run_driver("checks", dict(spec, rank=0, world=1, port=free_port()), folder, "checks")
        yield {"checks": results(single), "ranks": [results(p) for p in ranks]}


def ok(result):
    assert not (isinstance(result, dict) and "error" in result), result.get("trace", result)
    return result


def test_entry_point_loaded_by_vllms_load_general_plugins(engine_runs):
    load = ok(engine_runs["checks"]["load"])
    assert "engram_offload" in load["plugins"]
    assert load == {**load, "imported_before": False, "patched": True}  # patched when vLLM imports Engram


def test_every_vllm_name_the_plugin_touches(engine_runs):
    assert ok(engine_runs["checks"]["names"]) == {
        "Engram._create_embedding": ["self", "layout", "layer_hash_index"],
        "Engram._finish_prefetch": ["self", "event"],
        "Engram._finish_prefetch.wrapped": True,
        "Engram._finish_prefetch.inner": "patch.<locals>._finish_prefetch",
        "Engram._init_staging": ["self", "max_tokens", "head_dim"],
        "Engram.prepare_embeddings": ["self", "hash_ids"],
        "Engram._start_prefetch": ["self", "hash_ids", "rows"],
        "Engram._ready_rows": ["self", "num_tokens"],
        "Engram.embed": ["self", "hash_ids"],
        "ParallelEngramEmbedding.lookup": ["self", "indices", "out", "background"],
        "ParallelEngramEmbedding.collapse_huge_pages": ["self"],
        "ParallelEngramEmbedding._storage": ["self"],
        "ParallelEngramEmbedding._weight_loader": ["param", "loaded_weight"],
        "EngramLayout.__init__": ["self", "config"],
        "VllmConfig.fields": ["additional_config", "compilation_config", "engram_config", "model_config",
                              "scheduler_config"],
        "CUDAGraphMode.has_full_cudagraphs": ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
        "get_current_vllm_config": True,
        "tp_rank_and_size": True,
        "eager_break_during_capture": True,
    }


def test_checkpoint_names_reach_the_plugins_parameters(engine_runs):
    mapped = ok(engine_runs["checks"]["mapper"])
    for names in mapped.values():
        assert names == ["model.layers.1.engram.embed_tokens.weight",
                         "model.layers.1.engram.embed_tokens.weight_scale_inv"]
    params = engine_runs["checks"]["tiers"]["memory/layer1"]["params"]
    assert {"embed_tokens.weight", "embed_tokens.weight_scale_inv"} <= set(params)


def test_vllms_hash_kernel_equals_our_hasher_on_v41(engine_runs):
    hashed = ok(engine_runs["checks"]["hasher"])
    assert hashed["layout_primes_equal"] == [True, True]  # vLLM's EngramLayout of V4.1-Flash is ours
    assert hashed["shape"] == [12, 2, 24] and hashed["equal"] and hashed["dead_rows"] == 0


def test_inert_without_settings(engine_runs):
    inert = ok(engine_runs["checks"]["inert"])
    # vLLM's own table was being built (and, on a CPU, found no accelerator)
    assert inert["constructors"] == ["Engram", "ParallelEngramEmbedding"], inert


def test_host_read_tiers_refused_under_full_graphs(engine_runs):
    graphs = ok(engine_runs["checks"]["graphs"])
    assert graphs["memory"] == "built"
    for tier in ("direct+cache", "row_server"):
        assert "FULL CUDA graph cannot replay: start vLLM with --enforce-eager" in graphs[tier]


def test_checkpoint_rows_checked_and_discarded(engine_runs):
    loader = ok(engine_runs["checks"]["loader"])
    assert loader["placeholder_shapes"] == [[0, 256], [0, 8]]
    assert loader["placeholders"] == [["torch.float8_e4m3fn", "cpu", False], ["torch.uint8", "cpu", False]]
    assert "does not hold this checkpoint's rows" in loader["other_rows_refused"]


def test_wrong_table_and_unknown_key_refused(engine_runs):
    spec = engine_runs["checks"]["spec"]
    assert engine_runs["checks"]["wrong_table"].startswith(f"the table {spec['other_table']} was converted from "
                                                           "another model (")
    assert "unknown engram_offload setting(s) 'cache'" in engine_runs["checks"]["unknown_key"]


def test_graph_modes_staging_slots_and_the_start_up_line(engine_runs):
    plugin, spec = ok(engine_runs["checks"]["plugin"]), engine_runs["checks"]["spec"]
    assert plugin["eager_under_full_graphs"] == "Engram"  # --enforce-eager: no graphs replay a host read
    assert plugin["other_decode"] == "Engram"
    for refused in ("specialized_decode", "not_eager_under_full_graphs"):  # that decode replays FULL graphs
        assert plugin[refused].startswith(
            "the direct tier reads rows on the host, which a FULL CUDA graph cannot replay: start vLLM with "
            "--enforce-eager, or with -cc.cudagraph_mode=PIECEWISE"), refused
    slot = plugin["slot_bytes"]
    assert slot == 64 * 24 * CONFIG.row_bytes  # 64 batched tokens of 24 columns
    assert plugin["staging_short"] == (f"staging_bytes {slot - 1} holds less than one step's rows of layer 1 "
                                       f"({slot} bytes at 64 tokens): raise it")
    assert [plugin[f"staging_{n}"] for n in ("one", "three", "many", "default")] == [1, 3, 4, 2]
    assert plugin["started"] == [
        f"engram-offload: Engram layer 14 of rank 0/1 on {spec['table']} on memory (addressable backend, "
        "read by the GPU in place; columns [0, 24) of 24)",
        f"engram-offload: Engram layer 1 of rank 0/1 on {spec['table']} on {spec['socket']} (host-read backend, "
        "read on the host, the CPU waits for them; columns [0, 24) of 24)"]
    assert plugin["storage"] == "an engram-offload Engram table has no vLLM storage: its rows come from lookup()"
    assert plugin["collapse_huge_pages"] is None and plugin["stats_count"] and plugin["patched_once"]
    assert plugin["device_views"] == {"memory": True, "shared": True}  # two resident stores, a view of each
    staged = plugin["staged"]  # a GPU that cannot register the read-only segment: staged, said, refused in graphs
    assert staged["kind"] == "host-read" and staged["line"].endswith(
        "(host-read backend, read on the host, the CPU waits for them (staged: this GPU cannot read the shared "
        "tier's rows in place (read-only host memory it cannot register, or no coherent UVA)); columns [0, 24) of 24)")
    assert staged["full_graphs"].startswith("this GPU cannot read the shared tier's rows in place (read-only host "
                                            "memory it cannot register, or no coherent UVA): they would be staged "
                                            "on the host, which a FULL CUDA graph cannot replay: start vLLM with ")
    # the patched _finish_prefetch runs vLLM's wait on the event, then the rows read in the background
    assert plugin["lookup_lines"] == [  # log_every=1: a line a lookup, each backend's
        f"engram-offload layer 14 (addressable, {spec['table']} on memory)",
        f"engram-offload layer 14 (host-read, {spec['table']} on direct)"]
    assert plugin["timeout_memory"] is None and plugin["timeout_direct+cache"] == 0.5
    assert plugin["rows_before_finish"] == 0 and plugin["finish"]["waited"] == ["the step's event"]
    assert plugin["finish"]["rows_equal"] and plugin["finish"]["nonzero"] > 0


def check_tiers(run, rank, world):
    tiers = ok(run["tiers"])
    names = ("direct+cache", "layered", "memory", "row_server") + (("pool",) if run["spec"]["pool_table"] else ())
    assert sorted(tiers) == [f"{t}/layer{i}" for t in sorted(names) for i in (1, 14)]
    stores = {t: {tiers[f"{t}/layer{i}"]["store"] for i in (1, 14)} for t in names}
    assert all(len(s) == 1 for s in stores.values()) and len(set.union(*stores.values())) == len(names)  # one a tier
    # the memory tier holds the rank's share of each layer, one registration a layer
    assert tiers["memory/layer1"]["device_table"] != tiers["memory/layer14"]["device_table"]
    page_rows = 4096 // CONFIG.row_bytes
    share = 0
    for i in (1, 14):
        memory = tiers[f"memory/layer{i}"]
        owned = memory["attrs"][3] - memory["attrs"][2]  # vLLM's rows of the rank: vocab_end - vocab_start
        assert owned <= memory["device_rows"] <= owned + 2 * page_rows  # the rank's rows, widened to whole pages
        share += owned
    held = tiers["memory/layer1"]["dram_bytes"]  # the store's, both layers
    assert share * CONFIG.row_bytes <= held <= share * CONFIG.row_bytes + 2 * 2 * 4096
    if world > 1:
        assert held < 0.4 * tiers["memory/layer1"]["table_bytes"]  # this table's heads differ in size; V4.1's 0.25
    part = 24 // world
    assert len({entry["class_id"] for entry in tiers.values()}) == 1  # one subclass of vLLM's, made once
    for name, entry in tiers.items():
        assert entry["more_attrs"] == entry["vllm_more_attrs"], name
        tier, layer = name.split("/")[0], int(name.split("/layer")[1])
        in_place = tier == "memory" or (tier == "layered" and layer == 1)  # the placement: 1=memory/14=direct
        assert entry["stats"] == {"layer": layer, "backend": "addressable" if in_place else "host-read",
                                  "table": entry["stats"]["table"], "columns": [rank * part, rank * part + part],
                                  "lookups": 2, "rows": 2 * 3 * part}, name  # two lookups of 3 tokens
        assert entry["stats"]["table"].endswith({"memory": ".table on memory", "direct+cache": ".table on direct",
                                                 "row_server": "/" + SOCKET, "pool": " on remote",
                                                 "layered": f".table on {'memory' if layer == 1 else 'direct'}",
                                                 }[tier]), name
        assert entry["in_plugin_stats"] and entry["store_stats"], name
        assert entry["store_columns"] == [rank * part, rank * part + part], name  # caches hold the rank's rows
        assert entry["class"] == "OffloadedEngramEmbedding" and entry["base"] == "ParallelEngramEmbedding"
        assert entry["attrs"] == entry["vllm_attrs"], name  # vLLM's split, from vLLM's own constructor
        assert entry["attrs"][4] == world and entry["attrs"][1] == rank * 24 // world
        assert entry["bf16_equal"] and entry["packed_equal"], f"{name} of rank {rank}"
        assert entry["nonzero_rows"] > 0
        if world == 1:
            assert entry["embed_equal"], name


def test_rows_bit_equal_to_vllms_kernel_tp1(engine_runs):
    check_tiers(engine_runs["checks"], 0, 1)


@pytest.mark.parametrize("rank", range(WORLD))
def test_rows_bit_equal_to_vllms_kernel_tp4(engine_runs, rank):
    check_tiers(engine_runs["ranks"][rank], rank, WORLD)


def test_an_untested_vllm_version_with_settings_is_refused_unless_allowed(engine_runs):
    untested = ok(engine_runs["checks"]["untested"])
    assert untested["refused"] == (
        f"engram-offload was tested with vLLM 0.0.0, not {VLLM}: install one of those, or add "
        '"allow_untested_engine": true to the engram_offload settings to run it anyway (every vLLM name the plugin '
        "uses is there)")
    assert untested["allowed"] == "OffloadedEngramEmbedding"
    assert untested["warned"] == [f"engram-offload: running on vLLM {VLLM}, which it was not tested with (0.0.0), "
                                  "because allow_untested_engine is set; every vLLM name it uses is there"]


def test_an_untested_vllm_version_is_patched_and_inert_without_settings():
    code = ("import engram_offload.integrations.vllm as plugin\n"
            "plugin.TESTED_VERSIONS = ('0.0.0',)\n"
            "plugin.register()\n"
            "from vllm.models.deepseek_v41.common import engram as E\n"
            "print('patched', getattr(E.Engram, '_engram_offload_patched', False))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "patched True"  # every name there: the patch calls vLLM's own
    assert "engram-offload" not in done.stderr  # nothing to say without settings
