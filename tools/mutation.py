"""Mutation testing of one core module against its own tests (mutmut 3).

    python tools/mutation.py serving/dedup    # mutate src/engram_offload/serving/dedup.py, run tests/serving/test_dedup.py
    python tools/mutation.py planner/placement --workers 2
    python tools/mutation.py --list           # the modules and the tests each runs

Each module runs in its own scratch folder, ``.mutation/<module>/``: links to ``src`` and
``tests`` and a ``pyproject.toml`` whose ``[tool.mutmut]`` table is the repository's plus
this module's files and tests. mutmut copies them into ``mutants/`` there, mutates the
module's functions, and runs for each mutant only the tests that call the mutated function.
The script prints the score (killed / checked) and the diff of every mutant that survived.

Build the C helpers first (``make install``): the native paths are the ones tested.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "src/engram_offload"
SCRATCH = ROOT / ".mutation"

# module -> (its source files under the package, the tests that are its own)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "engram/hashing": (["engram/hashing.py"], ["tests/engram/test_hashing.py"]),
    "engram/config": (["engram/config.py"], ["tests/engram/test_config.py"]),
    "engram/rows": (["engram/rows.py"], ["tests/engram/test_rows.py", "tests/engram/test_rowdecode.py"]),
    "engram/layer": (["engram/layer.py"], ["tests/engram/test_layer.py", "tests/engram/test_released_checkpoint.py"]),
    "serving/dedup": (["serving/dedup.py"], ["tests/serving/test_dedup.py"]),
    "serving/prefetch": (["serving/prefetch.py", "serving/step.py", "serving/outputs.py", "serving/drafts.py"],
                         ["tests/serving/test_prefetch.py", "tests/serving/test_prefetch_drafts.py",
                          "tests/serving/test_prefetch_first_layer.py", "tests/serving/test_prefetch_own_parts.py"]),
    "serving/rowstore": (["serving/rowstore.py"], ["tests/serving/test_store.py", "tests/serving/test_layered.py"]),
    "serving/layered": (["serving/layered.py"], ["tests/serving/test_layered.py"]),
    "serving/sharding": (["serving/sharding.py"], ["tests/serving/test_sharding.py"]),
    "table": (["table/format.py", "table/writer.py"], ["tests/table"]),
    "tiers/base": (["tiers/base.py"], ["tests/tiers/test_tier_base.py"]),  # its closes fail fast, never hang
    "cache/policy": (["cache/policy.py"], ["tests/cache/test_policy.py", "tests/cache/test_cache_index.py"]),
    "cache/admission": (["cache/admission.py"],
                        ["tests/cache/test_admission.py", "tests/cache/test_cache_index.py"]),
    "cache/index": (["cache/index.py"], ["tests/cache/test_cache_index.py", "tests/cache/test_index.py"]),
    "cache/row_cache": (["cache/row_cache.py"], ["tests/cache"]),
    "cache/levels": (["cache/levels.py", "cache/lease.py"],
                     ["tests/cache/test_levels.py", "tests/cache/test_cached_store.py", "tests/cache/test_lease.py"]),
    "serving/store": (["serving/store.py"], ["tests/serving/test_store.py", "tests/cache",  # and open_table's row_server:
                             *(f"tests/serving/rowserver/test_rowserver.py::test_{name}" for name in (
                                 "open_table_with_a_row_server_refuses_local_options",
                                 "open_table_with_a_row_server_is_a_row_store_for_the_prefetcher",
                                 "a_row_client_with_columns_fetches_only_its_shard")),
                             "tests/tiers/test_remote.py::test_open_table_serves_the_pool_by_file_or_by_url_behind_a_cache"]),
    "bench/metrics": (["bench/metrics.py"], ["tests/bench/test_metrics.py"]),
    "planner/mrc": (["planner/mrc.py"], ["tests/planner/test_mrc.py"]),
    "planner/perf": (["planner/perf.py"], ["tests/planner/test_perf.py", "tests/planner/test_placement_rules.py"]),
    "planner/placement": (["planner/placement.py"],
                          ["tests/planner/test_placement_rules.py", "tests/planner/test_planner_placement.py"]),
    "planner/recommend": (["planner/recommend.py"], ["tests/planner/test_recommend.py"]),
    "planner/plan": (["planner/plan.py"], ["tests/planner"]),
    "buffers/recycle": (["buffers/recycle.py"], ["tests/buffers/test_recycle.py"]),
    "buffers/rowcopy": (["buffers/rowcopy.py"], ["tests/buffers/test_rowcopy.py"]),
    # the pool against real redis-server processes on 127.0.0.1 (tests/redis_servers.py); every
    # remote-tier test reads through the client and layout: pool/client runs its own tests only
    "pool/client": (["pool/client.py"], ["tests/pool"]),
    "pool/layout": (["pool/layout.py"], ["tests/pool", "tests/tiers/test_remote.py"]),
    "pool/publish": (["pool/publish.py"], ["tests/pool", "tests/tiers/test_remote.py"]),
    # every pool test starts servers; these are the ones aimed at starting and stopping them
    "pool/servers": (["pool/servers.py"], ["tests/pool/test_servers.py",
                                           "tests/pool/test_pool_safety.py::test_pools_started_together_on_free_ports_all_come_up",
                                           "tests/pool/test_pool_safety.py::test_a_taken_port_is_an_error_never_a_success"]),
    "serving/rowserver/server": (["serving/rowserver/server.py"], ["tests/serving/rowserver",
                                                                   "tests/commands/test_rowserver_command.py"]),
    "serving/rowserver/client": (["serving/rowserver/client.py"], ["tests/serving/rowserver"]),
    "serving/rowserver/protocol": (["serving/rowserver/protocol.py"], ["tests/serving/rowserver"]),
    "tiers/remote": (["tiers/remote.py"], ["tests/tiers/test_remote.py", "tests/pool"]),
    "bench/modeled": (["bench/modeled.py"], ["tests/bench/test_modeled.py"]),
    "bench/drafts": (["bench/drafts.py"], ["tests/bench/test_drafts.py"]),
    "model/drafts": (["model/drafts.py"], ["tests/model/test_model_drafts.py"]),
    # the model modules run the shipped trained model; the eval command's tests (10 to 15 s each,
    # the whole corpus) are left to the full suite: evaluate runs its fast tests and the scan's
    "model/evaluate": (["model/evaluate.py"], [
        *(f"tests/model/test_evaluate.py::test_{name}" for name in (
            "tiers_give_bit_identical_logits", "table_is_worth_something_on_held_out_text",
            "gate_zero_leaves_the_hidden_state_unchanged", "windows_overlap_by_one_token_and_keep_the_tail",
            "batches_group_equal_lengths_longest_first", "store_rows_reads_each_layer_at_its_base",
            "evaluate_is_the_mean_cross_entropy_of_every_target", "compare_lesions_every_gate_and_combines_the_kinds",
            "combined_weights_each_result_by_its_tokens")),
        "tests/model/test_scan.py"]),
    "model/scan": (["model/scan.py"], ["tests/model/test_scan.py"]),
    "model/ngrams": (["model/ngrams.py"], [f"tests/model/test_scan.py::test_{name}" for name in (
        "seen_ngrams_round_trip", "reads_of_unseen_ngrams_are_told_from_seen_ones",
        "with_an_empty_filter_every_read_is_unseen_and_each_order_has_its_share",
        "the_shipped_filter_knows_the_ngrams_of_common_python")]),
    # cache_sim's own tests on small traces, not the two that scan the trained model first
    "model/cache_sim": (["model/cache_sim.py"], [
        *(f"tests/model/test_cache_and_skip.py::test_{name}" for name in (
            "simulate_counts_hits_and_gate_share", "simulate_drives_the_policy_as_the_row_cache_does",
            "simulate_evicts_only_filled_slots_and_forgets_an_evicted_row", "simulate_of_no_reads_or_no_gate_is_zero",
            "compare_policies_sizes_each_cache_as_a_share_of_the_table"))]),
    "model/skip": (["model/skip.py"], [f"tests/model/test_cache_and_skip.py::test_{name}" for name in (
        "skip_is_off_by_default_and_saves_reads_when_asked", "skip_eval_reports_its_point_and_reads_rows_through_rows_for",
        "skip_curve_starts_with_every_read_and_matches_each_point_with_random_skips")]),
    "model/checkpoint_io": (["model/checkpoint_io.py"], ["tests/model/test_checkpoint_io.py"]),
    "model/corpus": (["model/corpus.py"], ["tests/model/test_corpus_reading.py", "tests/model/test_corpus_sources.py",
                                         "tests/model/test_corpus_files.py"]),
    "model/lm": (["model/lm.py"], ["tests/model/test_lm.py", "tests/model/test_train.py",
                                   "tests/model/test_model_drafts.py",
                                   "tests/model/test_evaluate.py::test_gate_zero_leaves_the_hidden_state_unchanged",
                                   "tests/model/test_evaluate.py::test_compare_lesions_every_gate_and_combines_the_kinds"]),
    "model/train": (["model/train.py"], ["tests/model/test_train.py"]),
    "model/serving": (["model/serving.py"], ["tests/model/test_evaluate.py"]),
    "tiers/shared": (["tiers/shared.py"], ["tests/tiers/test_shared_tier.py", "tests/tiers/test_shared_safety.py"]),
    "engram/checkpoint": (["engram/checkpoint.py"], ["tests/engram/test_checkpoint.py",
                                                     "tests/engram/test_released_checkpoint.py",
                                                     "tests/model/test_checkpoint_io.py",
                                                     "tests/table/test_convert_refusals.py"]),
    "integrations/settings": (["integrations/settings.py"], ["tests/integrations/test_settings.py"]),
    "integrations/lookup": (["integrations/lookup.py"], ["tests/integrations/test_lookup.py"]),
    # its engine tests read what vLLM printed in child processes, where mutmut maps no call:
    # tools/mutation_vllm.py runs each mutant against them (this entry makes the mutants)
    "integrations/vllm": (["integrations/vllm.py"], ["tests/integrations/test_vllm_register.py",
                                                     "tests/integrations/test_vllm_engine.py"]),
    # its engine tests import SGLang: run where it is installed (make engines-sglang; main() goes there)
    "integrations/sglang": (["integrations/sglang.py"], ["tests/integrations/test_sglang_rows.py",
                                                         "tests/integrations/test_sglang_engine.py"]),
}

# module -> [tool.mutmut] settings of its own. A prefetch mutant that stops the workers leaves
# tests waiting on rows that never come: 4x the tests' time (not mutmut's 15x) ends each wait
# in seconds, still far above what a correct run of those tests takes on a loaded machine.
SETTINGS: dict[str, dict[str, object]] = {
    "serving/prefetch": {"timeout_multiplier": 4.0},
    # a mutant that reads a live server's pipe or connects without a timeout blocks using no CPU:
    # mutmut's wall-clock bound (the multiplier times the tests' time) is what ends it
    "pool/servers": {"timeout_multiplier": 4.0},
    "serving/rowserver/client": {"timeout_multiplier": 4.0},
}

KILLED = {"killed", "caught by type check", "timeout", "segfault"}
LINE = re.compile(r"^\s+(\S+): (.+)$")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str, list)):
        return json.dumps(value)  # strings, numbers and lists of them read the same in TOML
    raise TypeError(f"cannot write {value!r} as a [tool.mutmut] setting")


def prepare(module: str, sources: list[str], tests: list[str]) -> Path:
    """A fresh scratch folder for ``module`` with its mutmut settings; returns it."""
    text = (ROOT / "pyproject.toml").read_text()
    settings = dict(tomllib.loads(text).get("tool", {}).get("mutmut", {}))
    settings["source_paths"] = ["src"]
    settings["only_mutate"] = [f"{PACKAGE}/{s}" for s in sources]
    settings["pytest_add_cli_args_test_selection"] = [t for t in tests if (ROOT / t.split("::")[0]).exists()]
    settings.update(SETTINGS.get(module, {}))
    # drop the repository's own [tool.mutmut] table; the scratch one replaces it
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    text += "\n[tool.mutmut]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in settings.items())

    work = SCRATCH / module.replace("/", ".")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "pyproject.toml").write_text(text)
    (work / "src").symlink_to(ROOT / "src")
    (work / "tests").symlink_to(ROOT / "tests")
    shared = ROOT.parent / "shared"  # the test vectors, where tests/conftest.py looks for them
    if shared.is_dir():
        (work / "shared").symlink_to(shared)
    return work


def mutmut(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("mutmut")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.run([str(exe), *args], cwd=work, env=env, text=True, capture_output=True)


def report(work: Path, module: str, seconds: float) -> int:
    """Print the score and the survivors' diffs; returns the number of survivors."""
    listing = mutmut(work, "results", "--all", "true")
    statuses = dict(m.groups() for m in map(LINE.match, listing.stdout.splitlines()) if m)
    if not statuses:
        print(listing.stdout + listing.stderr)
        raise SystemExit(f"mutmut reported no mutants for {module}")
    killed = sum(s in KILLED for s in statuses.values())
    unchecked = {n: s for n, s in statuses.items() if s in ("no tests", "not checked", "skipped")}
    survivors = sorted(n for n, s in statuses.items() if s not in KILLED and n not in unchecked)
    checked = len(statuses) - len(unchecked)
    print(f"\n{module}: {killed}/{checked} mutants killed ({100 * killed / max(checked, 1):.1f}%)"
          f", {len(survivors)} survived, {len(unchecked)} not reached by a test, {seconds:.0f} s", flush=True)
    for name, status in sorted(unchecked.items()):
        print(f"  {status}: {name}")
    for name in survivors:
        print(mutmut(work, "show", name).stdout.rstrip())
    return len(survivors)


def _in_sglangs_environment(argv: list[str]) -> int:
    """Run this script again with SGLang's environment (``make engines-sglang``), where the SGLang
    plugin's engine tests import SGLang in the test process."""
    python = ROOT / ".venv-sglang" / "bin" / "python"
    if not python.exists():
        raise SystemExit("integrations/sglang's engine tests need SGLang: run `make engines-sglang` first")
    if not python.with_name("mutmut").exists():
        raise SystemExit("mutmut is not installed beside SGLang: run "
                         "`.venv-sglang/bin/pip install -e '.[test,dev]' -c tools/engines-sglang.txt`")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.call([str(python), str(Path(__file__).resolve()), *argv], env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", nargs="?", help="a module name from --list")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--tests", nargs="+", help="test files or folders to run instead of the module's own")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    args = parser.parse_args(argv)
    if args.list or not args.module:
        for name, (sources, tests) in MODULES.items():
            print(f"{name:20} {' '.join(sources):38} {' '.join(tests)}")
        return 0
    if args.module not in MODULES:
        parser.error(f"unknown module {args.module!r}; choose one of: {', '.join(MODULES)}")
    if args.module == "integrations/vllm" and not args.tests:  # its tests run vLLM in child processes
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import mutation_vllm

        return mutation_vllm.main(["--workers", str(args.workers)])
    if args.module == "integrations/sglang" and not args.tests and importlib.util.find_spec("sglang") is None:
        return _in_sglangs_environment(argv if argv is not None else sys.argv[1:])
    sources, tests = MODULES[args.module]
    work = prepare(args.module, sources, args.tests or tests)
    start = time.monotonic()
    run = mutmut(work, "run", "--max-children", str(args.workers))
    if run.returncode != 0:
        print(run.stdout[-4000:] + run.stderr[-4000:])
        raise SystemExit(f"mutmut run failed for {args.module} (exit {run.returncode}); its files are in {work}")
    report(work, args.module, time.monotonic() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
