"""Mutation testing of ``integrations/vllm``, whose tests run vLLM in child processes.

mutmut maps a test to the functions it calls by recording the calls in the test's own process.
Every test of ``tests/integrations/test_vllm_engine.py`` reads what ``vllm_driver.py`` printed
from a child process, so mutmut maps none to the module and stops before the first mutant. This
runner takes mutmut's mutants (made in ``tools/mutation.py``'s scratch folder) and, for each,
runs the module's tests with that mutant active, in four stages, each only when the one before
passed:

  1. ``tests/integrations/test_vllm_register.py`` (in-process tests, no vLLM), under pytest;
  2. the driver's ``checks`` mode (one rank), and the tests of ``test_vllm_engine.py`` that
     read it, called on what it printed;
  3. the four ranks of a TP-4 gloo group: the TP-4 tests;
  4. the tests that start a child process of their own (``test_an_untested_vllm_version_is_left_alone``).

A mutant is killed when a test fails, a driver exits non-zero, or a driver passes its time
bound. The drivers are forked from this process after it imported vLLM once (about 8 s a run
saved); the trampolines mutmut puts in each function read ``MUTANT_UNDER_TEST`` at every call,
so a forked driver runs the mutant its environment names. Before the mutants, two runs check
the runner itself: with no mutant every test passes, and with mutmut's ``fail`` mutant (every
trampoline raises) the first stage fails.

    python tools/mutation_vllm.py                  # every mutant (resumes: results.json in the scratch)
    python tools/mutation_vllm.py --only _store    # the mutants whose names contain _store
    python tools/mutation_vllm.py --fresh          # forget earlier results
    python tools/mutation_vllm.py --workers 2      # two mutants at once
    python tools/mutation_vllm.py --survivors      # the survivors again, after new tests

Needs ``make engines`` (vLLM 0.33.0 on the CPU torch). Prints the score and each survivor's diff.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation  # noqa: E402  tools/mutation.py: the scratch folder, the module table, mutmut itself

ROOT = Path(__file__).resolve().parents[1]
MODULE = "integrations/vllm"
IN_PROCESS_TESTS = ROOT / "tests" / "integrations" / "test_vllm_register.py"
STAGE_TIMEOUT_S = {"checks": 240.0, "ranks": 360.0}  # a correct run takes 5-20 s

# the drivers' environment, set before torch or vLLM is imported (as run_driver sets it)
os.environ.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", VLLM_PLUGINS="engram_offload",
                  OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # no thread pool in this process: it forks


def scratch() -> Path:
    """mutmut's scratch folder with the module's mutants (made once; ``tools/mutation.py``'s layout)."""
    work = mutation.SCRATCH / MODULE.replace("/", ".")
    if not (work / "mutants" / "src").is_dir():
        sources, tests = mutation.MODULES[MODULE]
        work = mutation.prepare(MODULE, sources, tests)
        mutation.mutmut(work, "run", "--max-children", "1")  # makes the mutants, then stops: no test maps
    if not (work / "mutants" / "src").is_dir():
        raise SystemExit(f"mutmut made no mutants in {work}; run `python tools/mutation.py {MODULE}` to see why")
    return work


def mutant_names(work: Path) -> list[str]:
    listing = mutation.mutmut(work, "results", "--all", "true")
    names = [m.group(1) for m in map(mutation.LINE.match, listing.stdout.splitlines()) if m]
    if not names:
        raise SystemExit(f"mutmut lists no mutants in {work}:\n{listing.stdout}{listing.stderr}")
    return names


class Runner:
    """Forks the drivers with a mutant active and calls the test file's tests on their output."""

    def __init__(self, mutants: Path, folder: Path) -> None:
        for path in (ROOT / "tests", ROOT / "tests" / "integrations", mutants / "src"):
            sys.path.insert(0, str(path))  # the mutated package first; the tests as they are now
        os.environ["PYTHONPATH"] = os.pathsep.join([str(mutants / "src"), os.environ.get("PYTHONPATH", "")])
        os.chdir(mutants)
        import test_vllm_engine
        import vllm.config  # noqa: F401  the heavy imports, once, before any fork
        import vllm.distributed  # noqa: F401
        import vllm.plugins  # noqa: F401
        import vllm_driver

        import engram_offload

        if not Path(engram_offload.__file__).resolve().is_relative_to(mutants.resolve()):
            raise SystemExit(f"engram_offload imports from {engram_offload.__file__}, not from {mutants}")
        if vllm_driver.ENGRAM in sys.modules:
            raise SystemExit("vLLM's Engram module was imported before the drivers: the plugin's tests need it unloaded")
        self.tests, self.driver, self.folder = test_vllm_engine, vllm_driver, folder
        # the file's tests by what they take: the checks' results, a rank's, or nothing (own child)
        tests = [f for name, f in vars(test_vllm_engine).items() if name.startswith("test_") and callable(f)]
        by_args = {args: [f for f in tests if tuple(inspect.signature(f).parameters) == args]
                   for args in (("engine_runs",), ("engine_runs", "rank"), ())}
        if sum(map(len, by_args.values())) != len(tests) or not all(by_args.values()):
            raise SystemExit("test_vllm_engine.py has a test this runner cannot call: it calls tests taking "
                             "(engine_runs), (engine_runs, rank) or nothing")
        self.checks_tests, self.rank_tests, self.own_tests = by_args.values()

    def _child(self, mutant: str, out: Path, err: Path, run: Callable[[], int]) -> int:
        """Fork a child in a process group of its own that runs ``run()`` with the mutant active,
        its stdout into ``out`` and stderr into ``err`` (one file when they are equal), and exits
        with what ``run`` returned (1 if it raised); returns its pid."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)
                os.environ["MUTANT_UNDER_TEST"] = mutant
                with open(out, "w") as stdout, open(err, "w") if err != out else stdout as stderr:
                    os.dup2(stdout.fileno(), 1)
                    os.dup2(stderr.fileno(), 2)
                    code = run()
                    sys.stdout.flush()
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        return pid

    def _fork(self, mode: str, spec: dict[str, Any], name: str, mutant: str) -> tuple[int, Path]:
        path, out = self.folder / f"{name}.json", self.folder / f"{name}.out"
        path.write_text(json.dumps(spec))

        def drive() -> int:  # as `python vllm_driver.py MODE SPEC`
            sys.argv = [self.driver.__file__, mode, str(path)]
            os.chdir(self.folder)
            self.driver.main()
            return 0

        return self._child(mutant, out, self.folder / f"{name}.err", drive), out

    def _wait(self, children: list[tuple[int, Path]], timeout_s: float,
              parse: bool = True) -> list[dict[str, Any]] | str | None:
        """Each driver's JSON (``parse``; else None), or why the stage killed the mutant (a failed
        or timed-out child)."""
        deadline, codes = time.monotonic() + timeout_s, {}
        while len(codes) < len(children) and time.monotonic() < deadline:
            for pid, _ in children:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        for pid, _ in children:
            if pid not in codes:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if len(codes) < len(children):
            return "timeout"
        if any(codes.values()):
            return "failed"
        if not parse:
            return None
        return [json.loads(out.read_text().strip().splitlines()[-1]) for _, out in children]

    @staticmethod
    def _first_failure(tests: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> str | None:
        for test, args in tests:
            try:
                test(*args)
            except Exception as exc:
                lines = str(exc).strip().splitlines()
                return f"{test.__name__}: {type(exc).__name__}: {lines[0][:160] if lines else ''}"
        return None

    def _pytest(self, mutant: str) -> str | None:
        """Why the in-process tests failed with the mutant active (None: they passed)."""
        import pytest

        out = self.folder / "pytest.out"
        pid = self._child(mutant, out, out, lambda: int(pytest.main(["-q", "-x", "-p", "no:cacheprovider",
                                                                     str(IN_PROCESS_TESTS)])))
        failed = self._wait([(pid, out)], STAGE_TIMEOUT_S["checks"], parse=False)
        if failed is None:
            return None
        lines = [line for line in out.read_text().splitlines() if line.startswith("FAILED ")]
        return f"{re.sub(r'^.*?tests/', 'tests/', lines[0][7:200]) if lines else 'pytest'}: {failed}"

    def verdict(self, mutant: str, spec: dict[str, Any]) -> tuple[str, str]:
        """("killed" or "survived", by what)."""
        failed = self._pytest(mutant)
        if failed:
            return "killed", failed
        single = self._wait([self._fork("checks", dict(spec, rank=0, world=1, port=self.tests.free_port()),
                                        "checks", mutant)], STAGE_TIMEOUT_S["checks"])
        if isinstance(single, str):
            return "killed", f"checks: {single}"
        failed = self._first_failure([(t, ({"checks": _unmangled(single[0])},)) for t in self.checks_tests])
        if failed:
            return "killed", failed
        port, world = self.tests.free_port(), self.tests.WORLD
        ranks = self._wait([self._fork("rank", dict(spec, rank=r, world=world, port=port), f"rank{r}", mutant)
                            for r in range(world)], STAGE_TIMEOUT_S["ranks"])
        if isinstance(ranks, str):
            return "killed", f"ranks: {ranks}"
        failed = self._first_failure([(t, ({"ranks": ranks}, r)) for t in self.rank_tests for r in range(world)])
        if failed:
            return "killed", failed
        os.environ["MUTANT_UNDER_TEST"] = mutant
        try:
            failed = self._first_failure([(t, ()) for t in self.own_tests])
        finally:
            del os.environ["MUTANT_UNDER_TEST"]
        return ("killed", failed) if failed else ("survived", "")


def _unmangled(checks: dict[str, Any]) -> dict[str, Any]:
    """The checks as the unmutated module gives them: mutmut renames each mutated function
    (``patch`` is ``x_patch__mutmut_orig`` or ``x_patch__mutmut_N``), which the pinned qualified
    name of the patched ``_finish_prefetch`` shows."""
    names = checks.get("names")
    key = "Engram._finish_prefetch.inner"
    if isinstance(names, dict) and isinstance(names.get(key), str):
        names[key] = re.sub(r"^x_(\w+?)__mutmut_(?:orig|\d+)\.", r"\1.", names[key])
    return checks


def _save(path: Path, new: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge ``new`` into the results file under a lock (shards share it); returns them all."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(path.read_text()) if path.exists() else {}
        results.update(new)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run only the mutants whose names contain this text")
    parser.add_argument("--fresh", action="store_true", help="forget the results of earlier runs")
    parser.add_argument("--survivors", action="store_true", help="run again the mutants that survived before "
                        "(after new tests)")
    parser.add_argument("--workers", type=int, default=1, help="mutants run at once, each in a shard of its own "
                        "(default 1; the TP-4 stage alone runs four drivers)")
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # K/N: every N-th mutant from the K-th
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not installed: `make engines` installs vLLM 0.33.0 beside the CPU torch")
    work = scratch()
    names = mutant_names(work)
    k, n = (int(x) for x in args.shard.split("/"))
    saved = work / "results.json"
    if args.fresh:
        saved.unlink(missing_ok=True)
    done = _save(saved, {})
    shards = []
    if args.workers > 1 and n == 1:  # this process runs shard 0; the others their own, logged in the scratch
        n = args.workers
        for other in range(1, n):
            command = [sys.executable, __file__, "--shard", f"{other}/{n}"] + (["--survivors"] if args.survivors else [])
            command += ["--only", args.only] if args.only else []
            with open(work / f"shard-{other}.log", "w") as log:
                shards.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    rerun = {m for m, r in done.items() if args.survivors and r["status"] != "killed"}
    todo = [m for i, m in enumerate(names)
            if i % n == k and (m not in done or m in rerun) and (args.only is None or args.only in m)]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-vllm-") as tmp:
        runner = Runner(work / "mutants", Path(tmp))
        with runner.tests.engine_files(Path(tmp)) as spec:
            for check, want in (("", "survived"), ("fail", "killed")):
                got, why = runner.verdict(check, spec)
                if got != want:
                    raise SystemExit(f"the runner is broken: with MUTANT_UNDER_TEST={check!r} the tests {got} ({why})")
            print(f"runner checked ({time.monotonic() - start:.0f} s); {len(todo)} of {len(names)} mutants to run",
                  flush=True)
            for i, name in enumerate(todo, 1):
                t0 = time.monotonic()
                status, why = runner.verdict(name, spec)
                seconds = round(time.monotonic() - t0, 1)
                done = _save(saved, {name: {"status": status, "by": why, "seconds": seconds}})
                print(f"[{i}/{len(todo)}] {name}: {status} {why} ({seconds} s)", flush=True)
    for i, shard in enumerate(shards, 1):
        if shard.wait() != 0:
            print(f"shard {i} of {n} failed: see {work / f'shard-{i}.log'}", flush=True)
    if args.shard != "0/1":
        return 0  # the process that started this shard reports
    return report(work, names, _save(saved, {}), time.monotonic() - start)


def report(work: Path, names: list[str], done: dict[str, dict[str, Any]], seconds: float) -> int:
    ran = [n for n in names if n in done]
    killed = sum(done[n]["status"] == "killed" for n in ran)
    survivors = [n for n in ran if done[n]["status"] != "killed"]
    print(f"\n{MODULE}: {killed}/{len(ran)} mutants killed ({100 * killed / max(len(ran), 1):.1f}%), "
          f"{len(survivors)} survived, {len(names) - len(ran)} not run, {seconds:.0f} s this run")
    for name in survivors:
        print(mutation.mutmut(work, "show", name).stdout.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
