"""The corpus of code, documentation and prose a Debian machine has installed: the sources
found, the missing ones named with their package, man pages and HTML read as text, and the
token budget shared by kind."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from engram_offload.model.corpus import (
    KINDS,
    SOURCES,
    CorpusFile,
    Source,
    corpus_files,
    find_sources,
    html_text,
    kind_sequences,
    missing_sources_message,
    roff_text,
)

from corpus_fakes import CharTokenizer

MAN_PAGE = r'''.\" a comment line
.TH LS 1 "September 2022" "GNU coreutils 9.1" "User Commands"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
.B ls
lists \fIfiles\fR \(em sorted\e
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with .
'''


def test_roff_and_html_read_as_plain_text(tmp_path):
    text = roff_text(MAN_PAGE)
    assert text.splitlines() == ['LS 1 September 2022 GNU coreutils 9.1 User Commands', "NAME",
                                 "ls - list directory contents", "DESCRIPTION", "ls", "lists files — sorted\\",
                                 "-a, --all", "do not ignore entries starting with ."]
    page = tmp_path / "ls.1.gz"
    page.write_bytes(gzip.compress(MAN_PAGE.encode()))
    assert CorpusFile(page, "man/ls.1.gz", "documentation", "man").text() == text
    html = "<html><head><style>p {}</style><title>T</title></head><body><p>One &amp; two</p><p>three</p></body></html>"
    assert html_text(html).split() == ["T", "One", "&", "two", "three"]


def test_missing_sources_are_named_with_the_package_that_installs_them(tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "a.txt").write_text("some prose\n")
    here = Source("here", "prose", tmp_path / "here", ("*.txt",), "here-pkg", "CC0-1.0")
    gone = Source("gone", "documentation", tmp_path / "gone", ("*.txt",), "gone-doc", "GPL-2+")
    empty = Source("empty", "prose", tmp_path / "here", ("*.html",), "empty-doc", "GPL-2+")
    found, missing = find_sources([here, gone, empty])
    assert found == [here] and missing == [gone, empty]
    assert missing_sources_message(missing) == (
        f"corpus sources not installed, left out: gone (documentation, {tmp_path / 'gone'}), "
        f"empty (prose, {tmp_path / 'here'}): apt-get install empty-doc gone-doc installs them")
    assert missing_sources_message([]) == ""
    files = corpus_files(sources=[here, gone])
    assert [(f.name, f.kind) for f in files] == [("here/a.txt", "prose")]
    with pytest.raises(FileNotFoundError, match="no corpus source is installed"):
        corpus_files(sources=[gone])


def _kind_files(tmp_path, specs) -> list[CorpusFile]:
    """Files of ``size`` characters each, named and kinded by ``specs``: (name, kind, size)."""
    files = []
    for name, kind, size in specs:
        path = tmp_path / name.replace("/", "_")
        path.write_text("x" * size)
        files.append(CorpusFile(path, name, kind))
    return files


def test_the_budget_is_shared_by_kind_and_source(tmp_path):
    files = _kind_files(tmp_path, (("a/x.py", "code", 500), ("b/y.rst", "documentation", 500),
                                   ("c/z.txt", "prose", 40), ("d/w.txt", "prose", 500)))
    by_kind = kind_sequences(files, CharTokenizer(), 300)
    assert list(by_kind) == list(KINDS)
    sizes = {k: [s.size for s in v] for k, v in by_kind.items()}
    assert sizes == {"code": [100], "documentation": [100], "prose": [40, 60]}  # the small source's rest to the other
    assert all(s.dtype == np.int64 for v in by_kind.values() for s in v)


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.label)
def test_every_installed_source_reads_as_text(source):
    files = source.files() if source.root.is_dir() else []
    if not files:
        pytest.skip(f"{source.label} is not installed ({source.package}): {source.root}")
    assert source.kind in KINDS and source.licence
    sample = files[:: max(1, len(files) // 5)][:5]
    texts = [f.text() for f in sample]
    assert sum(len(t.split()) for t in texts) > 20, [f.name for f in sample]
    if source.format != "text":
        assert not any("<p>" in t or "\n.SH " in t for t in texts)


def test_held_out_split_covers_every_installed_kind():
    found = find_sources()[0]
    if {s.kind for s in found} != set(KINDS):
        pytest.skip("not every kind of text is installed (" + missing_sources_message(find_sources()[1]) + ")")
    held = [f for f in corpus_files() if f.held_out]
    assert {f.kind for f in held} == set(KINDS)
    assert all(isinstance(f.path, Path) for f in held)


def test_a_kinds_budget_goes_to_its_smaller_source_first_whatever_the_files_order(tmp_path):
    files = _kind_files(tmp_path, (("d/w.txt", "prose", 500), ("c/z.txt", "prose", 40)))
    assert [s.size for s in kind_sequences(files, CharTokenizer(), 100)["prose"]] == [40, 60]


def test_the_remainder_of_a_budget_goes_to_the_first_kinds_and_no_budget_reads_all(tmp_path):
    files = _kind_files(tmp_path, (("a/x.py", "code", 500), ("b/y.rst", "documentation", 500),
                                   ("d/w.txt", "prose", 500), ("e/v.txt", "prose", 16)))
    sizes = {k: [s.size for s in v] for k, v in kind_sequences(files, CharTokenizer(), 302).items()}
    assert sizes == {"code": [101], "documentation": [101], "prose": [16, 84]}
    sizes = {k: [s.size for s in v] for k, v in kind_sequences(files, CharTokenizer()).items()}
    assert sizes == {"code": [500], "documentation": [500], "prose": [16, 500]}  # min_tokens=16 keeps 16


def test_a_budget_too_small_to_share_goes_to_the_last_source(tmp_path):
    files = _kind_files(tmp_path, (("c/z.txt", "prose", 5), ("d/w.txt", "prose", 500), ("a/x.py", "code", 5)))
    by_kind = kind_sequences(files, CharTokenizer(), 2, min_tokens=1)  # one token a kind: 1 // 2 for the first source
    assert {k: [s.size for s in v] for k, v in by_kind.items()} == {"code": [1], "prose": [1]}
    assert by_kind["prose"][0].tolist() == [ord("x")]
    assert [s.size for s in kind_sequences(files, CharTokenizer(), min_tokens=1)["code"]] == [5]
