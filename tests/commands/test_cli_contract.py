"""One command-line contract: every sub-command's options are documented (help with the
default, and the unit of a size), a concept has one spelling across commands, and a removed
spelling is refused, hidden, naming the new one."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from engram_offload.cli import build_parser, main
from engram_offload.units import size_arg, size_or_percent_arg

# The removed spellings: refused, never shown in any help.
# --json: bench's old --json PATH; --no-engram: eval's old name of --lesion (train's --no-engram is the twin)
REMOVED = {"--model", "--cache", "--redis", "--nodes", "--json", "--no-engram", "--block-size"}
SHOWN_TOO = {"--json", "--no-engram"}  # removed in one command, current in another
# Options that take no default worth naming (a switch, a required or positional value).
SHARED = ("--preset", "--config", "--checkpoint", "--cache-bytes", "--policy", "--json", "--json-out", "--pool",
          "--pool-nodes", "--gpu", "--tp", "--threads", "--seed", "--no-progress", "--corpus", "--table", "--tier")
SIZE_UNIT = re.compile(r"bytes|\b\d+[KMGT]\b|KiB|MiB|GiB|%")


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every (name, parser) of a runnable sub-command, nested ones (pool publish) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _commands(sub, f"{prefix}{name} ")
                found.extend(inner or [(f"{prefix}{name}", sub)])
    return found


COMMANDS = _commands(build_parser())


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
            and a.dest != "debug"]


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def test_every_sub_command_is_walked():
    names = {name for name, _ in COMMANDS}
    assert {"info", "hash", "plan", "bench", "bench-tier", "eval", "pool publish", "pool serve", "trace"} <= names


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_has_help_with_its_default_and_unit(name, parser):
    problems = []
    one_of = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for action in _options(parser):
        flag = action.option_strings[0]
        if action.help == argparse.SUPPRESS:
            assert not set(action.option_strings) - REMOVED, f"{name} {flag}: hidden but not a removed spelling"
            continue
        assert not set(action.option_strings) & (REMOVED - SHOWN_TOO), f"{name} {flag}: a removed spelling shown"
        if not action.help:
            problems.append(f"{flag}: no help")
            continue
        takes_default = not _is_switch(action) and not action.required and action not in one_of
        if takes_default and "default" not in action.help and "required" not in action.help:
            problems.append(f"{flag}: help does not say the default")
        if action.type in (size_arg, size_or_percent_arg) and not SIZE_UNIT.search(action.help):
            problems.append(f"{flag}: a size whose help names no unit")
    assert not problems, f"{name}: {problems}"


def test_shared_flags_are_spelled_and_typed_alike():
    """A flag several commands share takes the same kind of value everywhere (a switch is a
    switch, a size a size, a name a name of the same list), and its default is in its help."""
    seen: dict[str, list[tuple[str, argparse.Action]]] = {}
    for name, parser in COMMANDS:
        for action in _options(parser):
            if action.help != argparse.SUPPRESS:
                for flag in action.option_strings:
                    seen.setdefault(flag, []).append((name, action))
    for flag in SHARED:
        uses = seen.get(flag, [])
        assert uses, f"{flag} is used by no command"
        kinds = {(_is_switch(a), a.metavar if not _is_switch(a) else None) for _, a in uses}
        assert len(kinds) == 1, f"{flag} takes different kinds of value: {[(n, a.nargs, a.metavar) for n, a in uses]}"
        if flag in ("--gpu", "--policy"):
            assert len({a.type for _, a in uses}) == 1 and len({a.choices for _, a in uses}) == 1, flag
    policies = {a.default for _, a in seen["--policy"]}
    assert policies == {"lfu"}, f"the cache policy default differs between commands: {policies}"


def test_json_is_a_switch_and_json_out_a_path_everywhere():
    for name, parser in COMMANDS:
        for action in _options(parser):
            if action.help == argparse.SUPPRESS:
                continue
            if "--json" in action.option_strings:
                assert _is_switch(action), f"{name} --json takes a value"
            if "--json-out" in action.option_strings:
                assert action.metavar == "PATH", name


@pytest.mark.parametrize("line,new", [
    (["plan", "--model", "deepseek-v4.1-flash", "--gpu", "b300"], "--preset"),
    (["eval", "--model", "ckpt"], "--checkpoint"),
    (["scan", "--model", "ckpt"], "--checkpoint"),
    (["eval", "--cache", "1M"], "--cache-bytes"),
    (["eval", "--no-engram"], "--lesion"),
    (["pool", "status", "--redis", "redis://127.0.0.1:7009"], "--pool"),
    (["pool", "serve", "--nodes", "1"], "--pool-nodes"),
    (["bench", "--json", "r.json"], "--json-out"),
    (["bench", "--model", "engram-27b"], "--backbone-preset"),
])
def test_removed_spellings_are_refused_naming_the_new_one(line, new, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(line)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    old = next(w for w in line if w in REMOVED)
    assert f"error: {old} was removed; use {new}" in err, err


def test_a_removed_option_without_a_replacement_says_why(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["make-table", "--full", "--out", "t.tbl", "--block-size", "65536"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --block-size was removed: tables carry page checksums only" in err, err


def test_sizes_are_printed_in_the_binary_unit_they_fill(tmp_path, capsys):
    cfg = {"engram_layer_ids": [2], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
           "engram_vocab_size": 1000, "hidden_size": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["info", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    table_line = next(line for line in out.splitlines() if line.startswith("table"))
    assert re.search(r"\(\d+\.\d (KiB|MiB)\)$", table_line), table_line  # not "(0.00 GiB)"
    assert "0.00 GiB" not in out


def _hints() -> list[tuple[str, str]]:
    """(file, text after "engram-offload ") of every string in the package's sources that
    tells the user a command to run."""
    import ast
    from pathlib import Path

    import engram_offload

    found = []
    for path in Path(engram_offload.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):  # an f-string: its literal parts, a value as X
                text = "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            found += [(path.name, hint) for hint in re.findall(r"engram-offload ([a-z][^;)\n]*)", text)]
    return found


def test_every_command_a_message_tells_the_user_to_run_takes_the_options_it_names():
    parsers = dict(COMMANDS)
    checked = 0
    for where, hint in _hints():
        words = hint.split()
        name = next((n for n in sorted(parsers, key=len, reverse=True) if words[:len(n.split())] == n.split()), None)
        if name is None:
            continue  # prose that names the tool, not a command line
        shown = {s for a in _options(parsers[name]) if a.help != argparse.SUPPRESS for s in a.option_strings}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", hint):
            assert flag in shown, f"{where}: 'engram-offload {hint}' names {flag}, which '{name}' does not show"
            checked += 1
    assert checked >= 3
