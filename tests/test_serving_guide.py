"""Every ``engram-offload`` command of docs/serving.md runs, as the guide gives it.

The commands are read from the guide's ``console`` blocks (``$ `` prompts, ``\\`` continuations,
a trailing ``&`` for a server left running) and run in the guide's order, as an operator would,
with the guide's paths and addresses replaced by the stand-ins of ``STAND_INS``: a tiny
checkpoint in the released DeepSeek-V4.1 format, a table path in a temporary folder, a Redis
server on 127.0.0.1 and a socket in a private folder. Each must exit 0, print no deprecation
note and print what ``CHECKS`` expects of its command. A command with a path or address this
table does not map, or with no check, fails: the guide cannot name a command nobody ran. The
README's serving snippet must use the guide's commands.
"""

from __future__ import annotations

import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch

from engram_offload.serving.rowserver import RowClient
from engram_offload.serving.store import open_table

from redis_servers import start_pool
from released_checkpoint import LAYERS, ReleasedCheckpoint, write_released_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "serving.md"
README = ROOT / "README.md"
PROGRAM = "engram-offload"
TIMEOUT_S = 300  # the longest one command (or a server's start) may take

# The guide's paths and addresses -> the stand-in the fixture makes for each.
STAND_INS = {
    "/models/DeepSeek-V4.1-Flash": "checkpoint",  # a tiny checkpoint in the released V4.1 format
    "/nvme/engram/v41f.table": "table",  # a path in a temporary folder (convert writes it)
    "/nvme/engram/v41f.index": "index",  # beside it (index writes the checkpoint's sidecar there)
    "/run/engram/rows.sock": "socket",  # a path in a private folder of /tmp (socket paths are short)
    "redis://10.0.0.5:7000": "pool",  # a Redis server on 127.0.0.1 started here
}


def _shell_lines(body: str, prompt: str) -> list[str]:
    """The commands of a shell block, each line starting with ``prompt`` (dropped), with their
    continuations joined: ``\\`` line ends, and lines inside a quoted string (a JSON setting over
    two lines). Other lines (a command's output) are left out."""
    lines = []
    current = None
    for line in re.sub(r"\\\n[ \t]*", " ", body).split("\n"):
        if current is None and not (line.startswith(prompt) and line.strip()):
            continue
        current = line[len(prompt):] if current is None else f"{current}\n{line}"
        try:
            shlex.split(current, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        lines.append(current)
        current = None
    assert current is None, f"a command never closes its quote: {current}"
    return lines


def _console_lines(text: str) -> list[str]:
    """The ``$ `` commands of ``text``'s console blocks (indented ones too), prompts dropped."""
    lines = []
    for indent, block in re.findall(r"^([ \t]*)```console\n(.*?)^\1```", text, re.M | re.S):
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in block.split("\n"))
        lines += _shell_lines(body, "$ ")
    return lines


def _program(words: list[str]) -> str | None:
    """The program a shell line runs (after any ``NAME=value`` assignments)."""
    return next((w for w in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w, re.S)), None)


def _normal(command: str) -> str:
    return " ".join(shlex.split(command, comments=True))


GUIDE_TEXT = GUIDE.read_text()
COMMANDS = [_normal(line) for line in _console_lines(GUIDE_TEXT)
            if _program(shlex.split(line, comments=True)) == PROGRAM]


# ---------------------------------------------------------------------- running the guide
@dataclass
class Run:
    """One command of the guide as it ran here (``skipped``: why it could not)."""

    argv: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    skipped: str | None = None
    wrong: str | None = None  # why the command could not be run at all
    seen: dict[str, object] = field(default_factory=dict)  # what a check of a server saw while it ran


@dataclass
class Guide:
    checkpoint: ReleasedCheckpoint
    stand_ins: dict[str, str | None]
    why_no_pool: str | None
    runs: list[Run]

    @property
    def table(self) -> Path:
        return Path(str(self.stand_ins["table"]))

    @property
    def socket(self) -> Path:
        return Path(str(self.stand_ins["socket"]))


def _argv(command: str, stand_ins: dict[str, str | None]) -> tuple[list[str], str | None, str | None]:
    """The command's words with the stand-ins, why it cannot run here (a stand-in missing: its
    test skips) and what is wrong with it (a path without a stand-in: its test fails)."""
    words = shlex.split(command, comments=True)
    if words[-1] == "&":
        words = words[:-1]
    argv = [str(Path(sys.executable).with_name(PROGRAM))]
    for word in words[1:]:
        if word in STAND_INS:
            value = stand_ins[STAND_INS[word]]
            if value is None:
                return [], f"no stand-in for {word}", None
            argv.append(value)
        elif word.startswith("/") or "://" in word:
            return [], None, f"{word!r} in `{command}` has no stand-in: add it to STAND_INS"
        else:
            argv.append(word)
    return argv, None, None


def _table_rows(checkpoint: ReleasedCheckpoint) -> torch.Tensor:
    """The table's rows as convert writes them: every Engram layer's rows, in layer order."""
    return torch.cat([checkpoint.raw_rows(layer) for layer in LAYERS])


def _serve(argv: list[str], guide: Guide, run: Run) -> None:
    """A server the guide leaves running (``&``): wait for its ready line (bounded), read rows
    through it, stop it with SIGTERM and keep what it printed."""
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    stdout = server.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()  # the ready line
    try:
        try:
            first = lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            first = ""
        run.seen["ready"] = first
        if first and server.poll() is None:
            with RowClient(guide.socket) as client:
                ids = np.arange(0, client.num_rows, 3)
                run.seen["rows_equal"] = torch.equal(client.read_raw(ids), _table_rows(guide.checkpoint)[ids])
                run.seen["tier"] = client.tier
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        rest, run.stderr = server.communicate(timeout=TIMEOUT_S)
        run.stdout = first + rest
        run.returncode = server.returncode
        run.seen["socket_left"] = guide.socket.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.fixture(scope="module")
def guide(tmp_path_factory) -> Iterator[Guide]:
    """The guide's commands run in order against the stand-ins (a command's failure is its test's)."""
    folder = tmp_path_factory.mktemp("guide")
    checkpoint = write_released_checkpoint(folder / "DeepSeek-V4.1-Flash")
    (folder / "nvme").mkdir()
    sockets = Path(tempfile.mkdtemp(prefix="guide-", dir="/tmp"))
    pool, why_no_pool = None, None
    try:
        pool = start_pool(1, folder / "redis")
    except pytest.skip.Exception as exc:  # no redis-server: the pool's commands skip with this
        why_no_pool = str(exc)
    stand_ins = {"checkpoint": str(checkpoint.path), "table": str(folder / "nvme" / "v41f.table"),
                 "index": str(folder / "nvme" / "v41f.index"),
                 "socket": str(sockets / "rows.sock"), "pool": pool.url if pool is not None else None}
    result = Guide(checkpoint, stand_ins, why_no_pool, [])
    try:
        for command in COMMANDS:
            argv, why_not, wrong = _argv(command, stand_ins)
            run = Run(argv, wrong=wrong)
            result.runs.append(run)
            if wrong is not None:
                continue
            if why_not is not None:
                run.skipped = f"{why_not}: {why_no_pool}"
            elif command.endswith(" &"):
                _serve(argv, result, run)
            else:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
                run.returncode, run.stdout, run.stderr = done.returncode, done.stdout, done.stderr
        yield result
    finally:
        if pool is not None:
            pool.stop()
        shutil.rmtree(sockets, ignore_errors=True)


# ---------------------------------------------------------------------- what each command prints
def _check_convert(guide: Guide, run: Run) -> None:
    assert run.stdout.startswith(f"wrote {guide.table}: "), run.stdout
    with open_table(guide.table, "mmap") as store:
        rows = store.read_raw(np.arange(store.num_rows))
    assert torch.equal(rows, _table_rows(guide.checkpoint))  # the checkpoint's bytes, unchanged


def _check_verify(guide: Guide, run: Run) -> None:
    assert run.stdout.startswith(f"{run.argv[-1]}: OK"), run.stdout  # the table, or the checkpoint's sidecar


def _check_index(guide: Guide, run: Run) -> None:
    sidecar = guide.stand_ins["index"]
    assert sidecar in run.stdout, run.stdout
    with open_table(sidecar, "mmap") as store:  # the checkpoint's shards, served as its table
        rows = store.read_raw(np.arange(store.num_rows))
    assert torch.equal(rows, _table_rows(guide.checkpoint))


def _check_plan(guide: Guide, run: Run) -> None:
    assert "Recommendation (" in run.stdout, run.stdout[-2000:]


def _check_row_server(guide: Guide, run: Run) -> None:
    tier = run.argv[run.argv.index("--tier") + 1] if "--tier" in run.argv else "direct"
    assert run.seen["ready"] == (f"serving {guide.table} ({tier} tier) on {guide.socket}; "
                                 "SIGTERM or Ctrl-C stops it\n"), run.stderr[-2000:]
    assert run.seen["tier"] == tier and run.seen["rows_equal"] is True
    assert "stopped (SIGTERM)" in run.stderr and run.seen["socket_left"] is False


def _published(guide: Guide) -> str:
    """The fingerprint ``pool publish`` printed."""
    for run in guide.runs:
        found = re.search(r"^table ([0-9a-f]{16}) is in the pool", run.stdout, re.M)
        if found:
            return found.group(1)
    pytest.fail("no command of the guide published the table (pool publish)")


def _check_pool_publish(guide: Guide, run: Run) -> None:
    fingerprint = _published(guide)
    assert f"{guide.stand_ins['pool']}/{fingerprint}" in run.stdout, run.stdout  # the table's pool URL


def _check_pool_status(guide: Guide, run: Run) -> None:
    fingerprint = _published(guide)
    assert re.search(rf"^table {fingerprint}: .*, complete$", run.stdout, re.M), run.stdout


def _check_shared_list(guide: Guide, run: Run) -> None:
    assert re.match(r"(No segments in |\d+ segment file\(s\) of this uid in )", run.stdout), run.stdout


CHECKS: dict[str, Callable[[Guide, Run], None]] = {
    "convert": _check_convert,
    "verify": _check_verify,
    "index": _check_index,
    "plan": _check_plan,
    "row-server": _check_row_server,
    "pool publish": _check_pool_publish,
    "pool status": _check_pool_status,
    "shared list": _check_shared_list,
}


def _check_of(command: str) -> Callable[[Guide, Run], None] | None:
    words = command.split()
    return CHECKS.get(" ".join(words[1:3])) or CHECKS.get(words[1])


# ---------------------------------------------------------------------- the tests
def test_the_guide_has_its_commands():
    assert len(COMMANDS) >= 7, COMMANDS
    assert all(_check_of(c) is not None for c in COMMANDS), [c for c in COMMANDS if _check_of(c) is None]


def test_every_console_line_that_names_the_program_runs_it():
    """No command hides behind another program (``sudo``, ``time``): those would not be run here."""
    for line in _console_lines(GUIDE_TEXT):
        words = shlex.split(line, comments=True)
        if PROGRAM in words:
            assert _program(words) == PROGRAM, line
        assert "engram_offload" not in words, f"the program is `{PROGRAM}`, not a module: {line}"


def test_every_command_named_in_the_text_is_run():
    """A command quoted in the guide's prose is one of its console commands (so it is run too)."""
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", GUIDE_TEXT, flags=re.M | re.S)
    quoted = [_normal(q) for q in re.findall(rf"`({PROGRAM} [^`]*)`", prose)]
    assert [q for q in quoted if q not in COMMANDS] == []


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=COMMANDS)
def test_the_guide_command_runs(guide, index):
    command, run = COMMANDS[index], guide.runs[index]
    if run.wrong is not None:
        pytest.fail(run.wrong)
    if run.skipped is not None:
        pytest.skip(run.skipped)
    assert run.returncode == 0, f"`{command}` exited {run.returncode}: {run.stderr[-3000:]}"
    assert "deprecated" not in (run.stdout + run.stderr).lower(), run.stderr[-3000:]
    check = _check_of(command)
    assert check is not None, f"no check for `{command}`: add one to CHECKS"
    check(guide, run)


def test_the_readme_serving_snippet_uses_the_guide_commands():
    text = README.read_text()
    start = text.index("## Serving")
    section = text[start:text.index("\n## ", start + 1)]
    snippet = []
    for block in re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S):
        snippet += [_normal(line) for line in _shell_lines(block, "")
                    if _program(shlex.split(line, comments=True)) == PROGRAM]
    assert snippet, "the README's serving section shows no engram-offload command"
    assert [c for c in snippet if c not in COMMANDS] == []
