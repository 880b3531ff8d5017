"""Which files make a corpus and what text each gives: a source's files (links, excluded names,
installed packages and second paths left out), the folders and files a user names, and the
plain text of man pages, HTML, gzipped and badly encoded files."""

from __future__ import annotations

import builtins
import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engram_offload.model import corpus
from engram_offload.model.corpus import (
    SOURCES,
    CorpusFile,
    Source,
    corpus_files,
    html_text,
    kind_of_suffix,
    missing_sources_message,
    roff_text,
    split,
    text_pieces,
)

from corpus_fakes import CharTokenizer


def _write(path: Path, text: str = "words\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_source_leaves_out_links_folders_packages_excluded_names_and_second_paths(tmp_path):
    root = tmp_path / "root"
    kept = [_write(root / f"keep{i:02}.txt") for i in range(20)]
    for i in range(20):  # mixed in with the kept ones, so that a stop at the first left out loses files
        _write(root / f"gcloud{i:02}.txt")
    (root / "link.txt").symlink_to(kept[0])
    (root / "folder.txt").mkdir()
    _write(root / "site-packages" / "inside.txt")
    _write(root / "dist-packages" / "inside.txt")
    _write(root / "sub" / "deep.txt")
    source = Source("label", "prose", root, ("*.txt", "**/*.txt"), "pkg", "CC0-1.0", exclude=("gcloud*",))
    files = source.files()
    assert [f.name for f in files] == [f"label/{p.name}" for p in kept] + ["label/sub/deep.txt"]
    assert all(f.kind == "prose" and f.format == "text" for f in files)
    assert files[0].path == kept[0]


def test_kind_of_suffix():
    assert [kind_of_suffix(Path(n)) for n in ("a.py", "b.rst", "c.txt", "d")] == ["code", "documentation", "prose",
                                                                                 "prose"]


def test_named_folders_and_files_make_a_corpus_each_labelled_by_its_name(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one / "m.py", "x = 1\n")
    _write(one / "d" / "guide.rst", "Guide\n")
    _write(one / "notes.txt")
    _write(one / "data.json", "{}")
    (one / "folder.py").mkdir()
    _write(one / "site-packages" / "lib.py")
    _write(one / "d" / "dist-packages" / "lib.py")
    _write(two / "other.txt")
    single = _write(tmp_path / "alone.py", "y = 2\n")
    files = corpus_files([single, one, two])
    assert [(f.name, f.kind, f.path) for f in files] == [
        ("alone.py", "code", single),
        ("one/d/guide.rst", "documentation", one / "d" / "guide.rst"),
        ("one/m.py", "code", one / "m.py"),
        ("one/notes.txt", "prose", one / "notes.txt"),
        ("two/other.txt", "prose", two / "other.txt"),
    ]


def test_a_corpus_that_is_not_a_folder_of_text_is_refused_with_what_to_give(tmp_path):
    other = _write(tmp_path / "table.json", "{}")
    with pytest.raises(ValueError, match=f"corpus {other} is not a .py/.txt/.rst file: give such a file or a folder"):
        corpus_files([other])
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"corpus {fifo} is neither a file nor a folder: give a folder"):
        corpus_files([fifo])
    with pytest.raises(FileNotFoundError, match=f"corpus folder {tmp_path / 'gone'} does not exist: give a folder"):
        corpus_files([tmp_path / "gone"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.py/\.txt/\.rst files under \['" + str(tmp_path / "empty")):
        corpus_files([tmp_path / "empty"])


def test_no_installed_source_names_every_package_to_install(tmp_path):
    gone = Source("gone", "prose", tmp_path / "gone", ("*.txt",), "gone-doc", "GPL-2+")
    with pytest.raises(FileNotFoundError) as error:
        corpus_files(sources=[gone])
    assert str(error.value) == "no corpus source is installed: " + missing_sources_message(list(SOURCES))
    assert "apt-get install " in str(error.value) and "python3.11-doc" in str(error.value)


def test_sources_of_every_package_are_named_without_an_install_hint(tmp_path):
    every = Source("copyright", "prose", tmp_path / "gone", ("*/copyright",), "every installed package", "each")
    one = Source("faq", "prose", tmp_path / "gone2", ("*.html",), "debian-faq", "GPL")
    assert missing_sources_message([every]) == f"corpus sources not installed, left out: copyright (prose, {tmp_path / 'gone'})"
    assert missing_sources_message([every, one]).endswith(": apt-get install debian-faq installs them")


def test_a_decoded_file_has_universal_newlines_and_bad_bytes_replaced(tmp_path):
    raw = b"one\r\ntwo\rthree\n\xff\xfe four\n"
    page = tmp_path / "page.html"
    page.write_bytes(b"<pre>" + raw + b"</pre>")
    assert CorpusFile(page, "x/page.html", "prose", "html").text() == "one\ntwo\nthree\n\ufffd\ufffd four\n"
    packed = tmp_path / "notes.txt.gz"
    packed.write_bytes(gzip.compress(raw))
    notes = CorpusFile(packed, "x/notes.txt.gz", "prose")
    assert not notes.plain and notes.text() == "one\ntwo\nthree\n\ufffd\ufffd four\n"
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"caf\xe9\nbien\n")
    assert CorpusFile(plain, "x/plain.txt", "prose").text() == "caf\ufffd\nbien\n"


def test_a_decoded_file_reads_at_most_four_bytes_a_character_it_keeps(tmp_path, monkeypatch):
    asked: list[int | None] = []

    class Recording:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=None):
            asked.append(n)
            return self.f.read(n)

    monkeypatch.setattr(corpus, "MAX_DECODED_CHARS", 1 << 14)
    monkeypatch.setattr(corpus, "open", lambda path, mode: Recording(builtins.open(path, mode)), raising=False)
    page = tmp_path / "big.1"
    page.write_bytes(b"word " * (1 << 18))  # 1.25 MiB
    text = CorpusFile(page, "man/big.1", "documentation", "man").text()
    assert len(text) == 1 << 14 and asked == [4 << 14]


def test_html_blocks_are_lines_and_scripts_are_left_out():
    html = ("<html><head><title>T</title><script>var x = 1;</script></head><body>"
            "<p>One <b>two</b> &amp; <i>three</i></p><div>\n\n\n</div><p>four</p>"
            "<script>\nhidden()\n</script><style>p {}</style><ul><li>five</li><li>six</li></ul></body></html>")
    assert html_text(html) == "T\n\nOne two & three\n\nfour\n\nfive\n\nsix\n"
    assert html_text("a</script>b<br>c") == "ab\nc\n"  # an end without a start skips nothing


def test_roff_comments_blank_lines_and_quote_requests_are_dropped():
    source = "first \\\" a comment \\\" more comment\n\n'br\n'\\\" a comment request\n.\nsecond\n"
    assert roff_text(source) == "first \nsecond"


ROFF_ESCAPES = [
    (r"a\-b", "a-b"), (r"a\eb", "a\\b"), (r"a\ b", "a b"), (r"a\~b", "a b"), (r"a\|b", "ab"), (r"a\^b", "ab"),
    (r"a\&b", "ab"), (r"a\cb", "ab"), (r"a\0b", "a b"), (r"a\,b", "ab"), (r"a\/b", "ab"), (r"a\%b", "a%b"),
    (r"a\(emb", "a—b"), (r"a\[lq]b\[rq]", "a“b”"), (r"a\(zzb", "ab"), (r"a\[nothing]b", "ab"),
    (r"\fBbold\fR \f(CWcode\f[] \s-2small\s0", "bold code small"), (r"a\*(Tmb\*Rc\*[str]d", "abcd"),
]


@pytest.mark.parametrize("source,text", ROFF_ESCAPES, ids=[s for s, _ in ROFF_ESCAPES])
def test_roff_escapes(source, text):
    assert roff_text(source) == text


def test_text_reads_as_utf8_whatever_the_locale(tmp_path):
    """Under an ASCII locale without Python's UTF-8 mode, a file's text (whole, in pieces, and
    decoded) is still read as UTF-8."""
    text = "naïve café — 日本語\n" * 50
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    (tmp_path / "doc.html").write_text(f"<pre>{text}</pre>", encoding="utf-8")
    script = (
        "import sys; from pathlib import Path\n"
        "from engram_offload.model.corpus import CorpusFile, text_pieces\n"
        "from corpus_fakes import CharTokenizer\n"
        "folder = Path(sys.argv[1])\n"
        "assert sys.flags.utf8_mode == 0, 'UTF-8 mode is on'\n"
        "print(ascii(CorpusFile(folder / 'doc.txt', 't/doc.txt', 'prose').text()))\n"
        "print(ascii(''.join(text_pieces(folder / 'doc.txt', CharTokenizer(), 64))))\n"
        "print(ascii(CorpusFile(folder / 'doc.html', 't/doc.html', 'prose', 'html').text()))\n"
    )
    package = Path(corpus.__file__).parents[2]  # the tree the package is imported from here
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C",
           "PYTHONPATH": os.pathsep.join([str(package), str(Path(__file__).parent)])}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                         encoding="utf-8", timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [ascii(text)] * 3
    assert CorpusFile(tmp_path / "doc.txt", "t/doc.txt", "prose").text() == text  # and here
    assert "".join(text_pieces(tmp_path / "doc.txt", CharTokenizer(), 64)) == text


def test_a_single_file_corpus_takes_the_kind_of_its_suffix(tmp_path):
    for name, kind in (("guide.rst", "documentation"), ("notes.txt", "prose"), ("m.py", "code")):
        path = _write(tmp_path / name)
        assert [(f.name, f.kind) for f in corpus_files([path])] == [(name, kind)]


def test_split_holds_out_the_files_whose_name_hash_falls_in_the_held_bucket(tmp_path):
    files = [CorpusFile(tmp_path / f"{i}.txt", f"t/{i}.txt", "prose") for i in range(400)]
    training, held = split(files)
    assert held == [f for f in files if f.held_out] and training == [f for f in files if not f.held_out]
    assert 400 // corpus.HELD_OUT_EVERY // 2 < len(held) < 400 // corpus.HELD_OUT_EVERY * 2


def test_the_training_corpus_leaves_out_every_file_the_out_of_domain_packages_installed(tmp_path, monkeypatch):
    root = tmp_path / "doc"
    theirs, ours = _write(root / "dictd" / "copyright"), _write(root / "bash" / "copyright")
    cookies = _write(tmp_path / "fortunes" / "cookies", "One.\n%\nTwo.\n")
    info = tmp_path / "info"
    _write(info / "dictd.list", f"/.\n{theirs.parent}\n{theirs}\n")
    _write(info / "libmaa4:amd64.list", "/usr/lib/libmaa.so.4\n")
    _write(info / "fortunes.list", f"{cookies}\n")
    _write(info / "bash.list", f"{ours}\n")
    assert corpus.package_paths(["dictd", "libmaa4", "fortunes", "absent"], info) == {
        "/.", str(theirs.parent), str(theirs), "/usr/lib/libmaa.so.4", str(cookies)}
    monkeypatch.setattr(corpus, "DPKG_INFO", info)
    fortunes = Source("fortunes", "prose", cookies.parent, ("*",), "fortunes", "free", "fortune")
    monkeypatch.setattr(corpus, "OUT_OF_DOMAIN", (fortunes,))
    copyright = Source("copyright", "prose", root, ("*/copyright",), "every installed package", "each")
    assert [f.path for f in corpus_files(sources=[copyright])] == [ours]
    assert [f.path for f in corpus_files(sources=[fortunes])] == [cookies]  # a source of its own keeps them


def test_no_file_of_an_installed_out_of_domain_source_or_package_is_trained_on():
    installed = corpus.find_sources(corpus.OUT_OF_DOMAIN)[0]
    if not installed:
        pytest.skip("no out-of-domain source is installed (apt-get install fortunes dict-devil)")
    training = {str(f.path) for f in corpus_files()}
    assert not training & {str(f.path) for s in installed for f in s.files()}
    assert not training & corpus.package_paths(corpus.OUT_OF_DOMAIN_PACKAGES)
    assert {s.label for s in corpus.OUT_OF_DOMAIN} == {"fortunes", "devil"}


def test_fortunes_lose_their_separators_and_a_dictzip_file_is_gunzipped(tmp_path):
    cookies = _write(tmp_path / "cookies", "One.\n%\nTwo,\n  three.\n%\n")
    assert CorpusFile(cookies, "f/cookies", "prose", "fortune").text() == "One.\n\nTwo,\n  three.\n\n"
    dz = tmp_path / "devil.dict.dz"
    with gzip.open(dz, "wt") as f:
        f.write("ABSURDITY, n. A statement.\n")
    assert not CorpusFile(dz, "d/devil.dict.dz", "prose").plain
    assert CorpusFile(dz, "d/devil.dict.dz", "prose").text() == "ABSURDITY, n. A statement.\n"
