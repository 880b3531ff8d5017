"""Every Python snippet of README.md runs, each in a fresh process, in a folder holding what
the README says it made: ``v41f.tbl`` (a small V4.1-Flash-layout table), ``t.tbl`` (the same,
published to a Redis pool started here, whose address stands for the README's
``redis://127.0.0.1:7001``), and ``DeepSeek-V4.1-Flash/`` (a tiny checkpoint in the released
format with its tokenizer.json). Each snippet must name nothing it does not define. Every
``engram-offload`` command of a ``console`` block prints what the README shows after it: all of
it, or the lines before a closing ``...``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.table import make_random_table

from released_checkpoint import write_released_checkpoint, write_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
README_POOL = "redis://127.0.0.1:7001"
CONSOLE = [(command, output) for block in re.findall(r"```console\n(.*?)```", README.read_text(), re.S)
           for command, output in re.findall(r"^\$ (engram-offload .*)\n((?:(?!\$ ).*\n)+)", block, re.M)]


def _first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from")))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    make_random_table(d / "v41f.tbl", EngramConfig.from_name("deepseek-v4.1-flash").scaled(5e-5), seed=0)
    shutil.copyfile(d / "v41f.tbl", d / "t.tbl")
    checkpoint = write_released_checkpoint(d / "DeepSeek-V4.1-Flash")
    write_tokenizer(checkpoint.path / "tokenizer.json")
    return d


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("code", SNIPPETS, ids=[_first_line(c)[:40] for c in SNIPPETS])
def test_every_name_a_snippet_uses_is_defined_in_it(code):
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F821,F811",
                          "--stdin-filename", "snippet.py", "-"], input=code, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("code", SNIPPETS, ids=[_first_line(c)[:40] for c in SNIPPETS])
def test_every_snippet_runs(code, folder, tmp_path):
    if '"cuda"' in code and not torch.cuda.is_available():
        pytest.skip("a GPU snippet: needs CUDA (its names are checked above)")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1"}
    pool = None
    if README_POOL in code:
        from engram_offload.pool.publish import publish_table

        from redis_servers import start_pool

        pool = start_pool(1, tmp_path / "pool")
        publish_table(str(folder / "t.tbl"), pool.url, progress=False)
        code = code.replace(README_POOL, pool.url)
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        if pool is not None:
            pool.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (folder / "rows.sock").exists()  # the row server removed its socket


def test_the_readme_shows_command_outputs():
    assert len(CONSOLE) >= 2


@pytest.mark.parametrize(("command", "shown"), CONSOLE, ids=[c for c, _ in CONSOLE])
def test_every_console_command_prints_what_the_readme_shows(command, shown):
    program = Path(sys.executable).with_name("engram-offload")
    run = subprocess.run([str(program), *shlex.split(command)[1:]], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = shown.rstrip("\n").split("\n")
    printed = [line.rstrip() for line in run.stdout.rstrip("\n").split("\n")]
    if lines[-1] == "...":
        lines = lines[:-1]
        printed = printed[:len(lines)]
    assert printed == [line.rstrip() for line in lines]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
