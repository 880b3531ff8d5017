"""``train``, ``eval`` and ``scan`` on the paths an operator gives them: checked before any work,
each mistake one line naming the path and the fix."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from engram_offload.cli import main
from engram_offload.model.corpus import corpus_files, split

TINY_TRAIN = ["--steps", "1", "--batch", "1", "--seq-len", "8", "--max-train-tokens", "3000", "--no-progress"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """Real standard-library files (the json, email and http packages), with a held-out file."""
    root = tmp_path_factory.mktemp("corpus") / "lib"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "http"):
        for f in sorted((stdlib / package).rglob("*.py")):
            target = root / f.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    assert all(split(corpus_files([root])))
    return root


def test_train_out_an_existing_file_is_refused_before_training(small_corpus, tmp_path, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert main(["train", "--out", str(existing), "--corpus", str(small_corpus), *TINY_TRAIN[:-1]]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"engram-offload train: error: --out {existing} is a file: give a folder to write the checkpoint "
        "into (created if missing)"]  # one line, and no "tokenizing ..." progress: nothing ran
    assert existing.read_text() == "keep me"


def test_train_out_under_a_file_or_a_plot_in_a_missing_folder_is_refused(small_corpus, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["train", "--out", str(tmp_path / "f" / "model"), *TINY_TRAIN]) == 2
    assert f"--out: {tmp_path / 'f'} is a file, not a folder" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "m"), "--plot", str(tmp_path / "no" / "l.png"), *TINY_TRAIN]) == 2
    assert f"--plot: folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_train_out_dot_names_the_plot_after_the_folder(small_corpus, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["train", "--out", ".", "--corpus", str(small_corpus), *TINY_TRAIN]) == 0
    assert f"loss curve {tmp_path / 'work-loss.png'}" in capsys.readouterr().out
    assert (tmp_path / "work-loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "-loss.png").exists() and (work / "config.json").is_file()


def test_eval_corpus_may_be_one_file(small_corpus, capsys):
    one = small_corpus / "json" / "decoder.py"
    assert main(["eval", "--corpus", str(one), "--all-files", "--max-tokens", "300", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"tokens": 299' in out and '"windows": 3' in out  # 300 tokens: 3 windows of up to 129, sharing one
    assert main(["scan", "--corpus", str(one), "--all-files", "--max-tokens", "300", "--json"]) == 0
    assert '"tokens": 299' in capsys.readouterr().out


def test_eval_corpus_of_another_kind_of_file_says_so(tmp_path, capsys):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\0" * 10)
    assert main(["eval", "--corpus", str(data), "--all-files"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"engram-offload eval: error: corpus {data} is not a .py/.txt/.rst file: "
                                        "give such a file or a folder of them"]


def test_eval_reads_a_users_corpus_whole_and_the_training_corpus_held_out(small_corpus, tmp_path, capsys):
    import json

    few = tmp_path / "mine"  # a corpus of the user's: three files, too few for a held-out one
    few.mkdir()
    for name in ("scanner.py", "decoder.py", "encoder.py"):
        shutil.copyfile(small_corpus / "json" / name, few / name)
    assert main(["eval", "--corpus", str(few), "--max-tokens", "0", "--json"]) == 0  # the shipped model
    whole = json.loads(capsys.readouterr().out)
    assert main(["eval", "--corpus", str(few), "--all-files", "--max-tokens", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == whole["tokens"] > 0
    # a checkpoint trained on a corpus reads only that corpus's held-out files
    model = tmp_path / "model"
    assert main(["train", "--out", str(model), "--corpus", str(small_corpus), *TINY_TRAIN]) == 0
    capsys.readouterr()
    held = split(corpus_files([small_corpus]))[1]
    assert main(["eval", "--checkpoint", str(model), "--corpus", str(small_corpus), "--max-tokens", "0",
                 "--json"]) == 0
    held_out = json.loads(capsys.readouterr().out)
    assert main(["eval", "--checkpoint", str(model), "--corpus", str(small_corpus), "--all-files",
                 "--max-tokens", "20000", "--json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert 0 < held_out["tokens"] < every["tokens"] and len(held) < len(corpus_files([small_corpus]))
    # and another corpus through that checkpoint: whole
    assert main(["eval", "--checkpoint", str(model), "--corpus", str(few), "--max-tokens", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == whole["tokens"]


def test_eval_reports_the_twin_and_the_lesion_on_the_same_tokens_per_kind(small_corpus, tmp_path, capsys):
    import json

    model, twin = tmp_path / "m", tmp_path / "m-no-engram"
    assert main(["train", "--out", str(model), "--corpus", str(small_corpus), *TINY_TRAIN]) == 0
    assert main(["train", "--out", str(twin), "--corpus", str(small_corpus), "--no-engram", *TINY_TRAIN]) == 0
    capsys.readouterr()
    mixed = tmp_path / "mixed"  # one file of each kind: code, documentation, prose
    mixed.mkdir()
    shutil.copyfile(small_corpus / "json" / "decoder.py", mixed / "decoder.py")
    (mixed / "guide.rst").write_text("Reading JSON\n============\n\nUse ``json.loads`` to decode a document.\n" * 20)
    (mixed / "letter.txt").write_text("Dear reader, the weather was fine and we walked to the river.\n" * 20)
    assert main(["eval", "--checkpoint", str(model), "--corpus", str(mixed), "--max-tokens", "900", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["twin"] == str(twin.resolve())
    assert list(record["by_kind"]) == ["code", "documentation", "prose", "all"]
    for kind, row in record["by_kind"].items():
        assert set(row) == {"engram", "twin", "lesion"}, kind
        assert row["engram"]["tokens"] == row["twin"]["tokens"] == row["lesion"]["tokens"] > 0, kind
    assert record["by_kind"]["all"]["engram"]["tokens"] == record["tokens"] == \
        sum(record["by_kind"][k]["engram"]["tokens"] for k in ("code", "documentation", "prose"))
    assert record["twin_over_engram"] == pytest.approx(
        record["by_kind"]["all"]["twin"]["perplexity"] / record["perplexity"])
    assert main(["eval", "--checkpoint", str(model), "--corpus", str(mixed), "--max-tokens", "900"]) == 0
    printed = capsys.readouterr().out
    assert "table's worth: twin / Engram" in printed and "lesion (gate forced to 0) / Engram" in printed


def test_eval_twin_must_be_a_model_without_engram(small_corpus, tmp_path, capsys):
    model = tmp_path / "m"
    assert main(["train", "--out", str(model), "--corpus", str(small_corpus), *TINY_TRAIN]) == 0
    capsys.readouterr()
    one = str(small_corpus / "json" / "decoder.py")
    assert main(["eval", "--checkpoint", str(model), "--corpus", one, "--twin", str(model)]) == 2
    assert "has Engram layers" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(model), "--corpus", one, "--twin", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(model), "--corpus", one, "--max-tokens", "200"]) == 0
    assert "no twin at" in capsys.readouterr().out


def test_train_names_the_corpus_sources_not_installed(tmp_path, monkeypatch, capsys):
    from engram_offload.model import corpus

    missing = corpus.Source("debian-faq", "prose", tmp_path / "not-installed", ("*.en.html",), "debian-faq", "GPL-2+")
    monkeypatch.setattr(corpus, "SOURCES", (corpus.SOURCES[0], missing))  # the standard library, and one missing
    assert main(["train", "--out", str(tmp_path / "m"), *TINY_TRAIN]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"corpus sources not installed, left out: debian-faq (prose, {tmp_path / 'not-installed'})"
                                        ": apt-get install debian-faq installs them"]
