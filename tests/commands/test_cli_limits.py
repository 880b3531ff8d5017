"""The command line at the machine's limits: size options that cannot fit are refused before
anything is allocated (exit 2), an address-space limit or an interrupted start-up end in one
line naming what ran out and what to do, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engram_offload.cli import main
from engram_offload.table import make_random_table

from tiny_tables import tiny_config

HUGE = str(10**13)  # rows, tokens or bytes no machine has the memory for


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_random_table(tmp_path_factory.mktemp("limits") / "t.tbl", tiny_config(), seed=0)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BENCH_TIER = ["bench-tier", "--tier", "mmap", "--seconds", "0.1"]


@pytest.mark.parametrize("argv, option", [
    (BENCH_TIER + ["--batch", HUGE], "--batch"),
    (BENCH_TIER + ["--callers", HUGE], "--callers"),
    (BENCH_TIER + ["--queue-depth", HUGE], "--queue-depth"),
    (BENCH_TIER + ["--cache-bytes", "900T"], "--cache-bytes"),
    (BENCH_TIER + ["--prefetcher", "--sequences", HUGE], "--sequences"),
    (BENCH_TIER + ["--prefetcher", "--corpus", "zipf", "--corpus-tokens", HUGE], "--corpus-tokens"),
    (["bench", "--no-progress", "--hidden", "100000000"], "--hidden"),
    (["bench", "--no-progress", "--concurrency", f"1,{HUGE}"], "--concurrency"),
    (["bench", "--no-progress", "--max-step-tokens", HUGE], "--max-step-tokens"),
    (["bench", "--no-progress", "--dram-budget", "none", "--cache-bytes", "900T"], "--cache-bytes"),
    (["eval", "--seq-len", "100000000"], "--seq-len"),
    (["eval", "--tier", "mmap", "--cache-bytes", "900T"], "--cache-bytes"),
    (["scan", "--seq-len", "100000000"], "--seq-len"),
    (["train", "--out", "{tmp}/m", "--batch", HUGE], "--batch"),
    (["train", "--out", "{tmp}/m", "--seq-len", "100000000"], "--seq-len"),
])
def test_a_size_option_beyond_memory_is_refused_up_front(table, tmp_path, capsys, argv, option):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0].startswith("bench"):
        argv += ["--table", str(table)]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert f"error: {option} " in line and "needs at least" in line and f"give a smaller {option}" in line
    assert not (tmp_path / "m").exists()


def _limited(script: str, headroom: int) -> subprocess.CompletedProcess:
    """Run ``script`` in a child whose address space may grow ``headroom`` bytes past what its
    imports (the CLI, torch) mapped."""
    prelude = textwrap.dedent(f"""
        import resource
        import torch  # noqa: F401
        from engram_offload.cli import main
        mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + {headroom}, resource.RLIM_INFINITY))
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=120)


def test_threads_beyond_the_address_space_limit_are_refused_up_front(table):
    """Started one by one, threads past the limit sometimes fail inside the C library, which
    aborts the process ("failed to register TLS destructor"): their stacks are counted first."""
    run = _limited(f"""
        raise SystemExit(main(["bench-tier", "--table", "{table}", "--tier", "mmap", "--queue-depth", "1000",
                               "--batch", "16", "--seconds", "1"]))
    """, 512 << 20)  # 1,000 caller threads' stacks (8 MiB each by default) cannot fit in 512 MiB
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "--queue-depth 1000 starts 1,000 threads whose stacks need" in lines[0]
    assert "left under the address-space limit (ulimit -v): give a smaller --queue-depth or raise the limit" in lines[0]


def test_a_thread_that_cannot_start_says_so(monkeypatch, capsys, table):
    """Past the up-front count (a limit reached another way), a thread that cannot start is one
    line naming the limit, not a traceback."""
    import threading

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    code = main(["bench-tier", "--table", str(table), "--tier", "mmap", "--queue-depth", "4", "--batch", "16",
                 "--seconds", "0.2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("engram-offload bench-tier: error: cannot start "
                                                              "another thread ("), err


def test_a_table_beyond_the_address_space_limit_is_refused_up_front(tmp_path):
    big = make_random_table(tmp_path / "big.tbl", tiny_config(starts=(400_000, 500_000)), seed=0)  # ~60 MiB
    run = _limited(f"""
        raise SystemExit(main(["bench-tier", "--table", "{big}", "--tier", "memory", "--seconds", "0.1"]))
    """, 16 << 20)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "--tier memory needs at least" in lines[0] and "left under the address-space limit (ulimit -v)" in lines[0]


def test_sigint_while_starting_is_one_line_and_130():
    """SIGINT while the command modules load (the injected pause stands for a slow import)."""
    script = textwrap.dedent("""
        import signal, sys, time
        # a suite started as a shell's background job hands its children SIGINT ignored: restore it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from engram_offload.cli import main
        from engram_offload.commands import core
        def slow_register(sub):
            print("loading", flush=True)
            time.sleep(60)
        core.register = slow_register
        raise SystemExit(main(["info", "--preset", "deepseek-v4.1-flash"]))
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "loading\n"
        child.send_signal(2)  # SIGINT
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert err.strip().splitlines() == ["engram-offload: interrupted (SIGINT) while starting; nothing was done"]


def test_eval_under_a_tight_address_space_limit_is_refused_before_loading():
    """The tokenizer aborts the process when an allocation fails: the room it needs is checked first."""
    run = _limited("""
        raise SystemExit(main(["eval", "--max-tokens", "100"]))
    """, 100 << 20)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert run.stderr.startswith("engram-offload eval: error: loading the model and the tokenizer needs at least ")
    assert run.stderr.strip().endswith("left under the address-space limit (ulimit -v): raise the address-space "
                                       "limit (ulimit -v) or free memory")
