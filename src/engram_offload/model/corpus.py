"""The training and held-out text, split by file and sorted into three kinds: code (CPython's
standard library), documentation (Python's documentation sources, man pages) and prose
(licence texts, packages' copyright files, the Debian Reference, the Debian FAQ, Debian's own
documents), all from what a Debian machine has installed (``SOURCES``; nothing is
downloaded: ``find_sources`` says which are missing and which package installs each).

A file is held out when the SHA-256 of its path relative to its corpus root falls in one
bucket of ``HELD_OUT_EVERY``: the split is the same on every machine and for every tool
(training, ``eval``, ``scan``), and no file's text is on both sides.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sysconfig
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from ..engram.tokenizer import append_capped

__all__ = ["CorpusFile", "Source", "SOURCES", "KINDS", "corpus_files", "find_sources", "missing_sources_message",
           "split", "token_sequences", "kind_sequences", "text_pieces", "DOCS_ROOT", "EOS_ID",
           "HELD_OUT_EVERY", "PIECE_CHARS"]

DOCS_ROOT = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc
HELD_OUT_EVERY = 20  # one file in 20 is held out
EOS_ID = 1  # DeepSeek's "<｜end▁of▁sentence｜>"
SUFFIXES = (".py", ".txt", ".rst")
KINDS = ("code", "documentation", "prose")
# A file whose text is not plain (a man page, an HTML page, gzipped) is read whole, at most this much.
MAX_DECODED_CHARS = 8 << 20


@dataclass(frozen=True)
class Source:
    """Text a Debian machine may have installed: the files matching ``patterns`` under ``root``."""

    label: str  # the first part of its files' names: "man/man1/ls.1.gz"
    kind: str  # one of KINDS
    root: Path
    patterns: tuple[str, ...]  # globs under root
    package: str  # the Debian package(s) that install it
    licence: str
    format: str = "text"  # "text", "man" (roff) or "html"; a ".gz" file is gunzipped first

    def files(self) -> list["CorpusFile"]:
        """Its files, sorted by name; symbolic links and a second path to the same file are left out."""
        found: dict[str, Path] = {}
        for pattern in self.patterns:
            for p in self.root.glob(pattern):
                if p.is_symlink() or not p.is_file() or "site-packages" in p.parts or "dist-packages" in p.parts:
                    continue
                found.setdefault(p.relative_to(self.root).as_posix(), p)
        return [CorpusFile(found[n], f"{self.label}/{n}", self.kind, self.format) for n in sorted(found)]


SOURCES: tuple[Source, ...] = (
    Source("stdlib", "code", Path(sysconfig.get_paths()["stdlib"]), ("**/*.py",),
           "python3.11 (the running CPython's standard library)", "PSF-2.0"),
    Source("docs", "documentation", DOCS_ROOT, ("**/*.txt",), "python3.11-doc", "PSF-2.0"),
    Source("man", "documentation", Path("/usr/share/man"), ("man[1-8]/*",),
           "manpages, manpages-dev, and every installed package's English man pages",
           "each page's package's licence (manpages: GPL-2+, BSD and verbatim-copying licences)", "man"),
    Source("licences", "prose", Path("/usr/share/common-licenses"), ("*",), "base-files",
           "the licence texts themselves (verbatim copying permitted)"),
    Source("copyright", "prose", Path("/usr/share/doc"), ("*/copyright",), "every installed package",
           "each package's own copyright file (verbatim copying permitted)"),
    Source("debian-reference", "prose", Path("/usr/share/doc/debian-reference-en/docs"), ("*.en.html",),
           "debian-reference-en", "GPL-2+", "html"),
    Source("debian-faq", "prose", Path("/usr/share/doc/debian/FAQ"), ("*.en.html",), "debian-faq", "GPL-2+", "html"),
    Source("doc-debian", "prose", Path("/usr/share/doc/debian"), ("*.txt", "*.txt.gz", "debian-manifesto.gz"),
           "doc-debian", "verbatim copying permitted (Debian's social contract, constitution, manifesto)"),
)


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    name: str  # the path relative to its corpus root, with the root's label: "stdlib/json/decoder.py"
    kind: str = "code"  # one of KINDS
    format: str = "text"  # "text", "man" or "html" (gzipped when the path ends in .gz)

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(self.name.encode()).digest()
        return int.from_bytes(digest[:8], "little") % HELD_OUT_EVERY == 0

    @property
    def source(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def plain(self) -> bool:
        """Read as it is (and so in pieces when large), not decoded from roff, HTML or gzip."""
        return self.format == "text" and self.path.suffix != ".gz"

    def text(self) -> str:
        """The file's text: UTF-8 (bad bytes replaced, universal newlines), gunzipped, man pages
        and HTML as plain text (those at most ``MAX_DECODED_CHARS``)."""
        if self.plain:
            return _read(self.path)
        with (gzip.open(self.path, "rb") if self.path.suffix == ".gz" else open(self.path, "rb")) as f:
            raw = f.read(4 * MAX_DECODED_CHARS)
        text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        if self.format == "man":
            text = roff_text(text)
        elif self.format == "html":
            text = html_text(text)
        return text[:MAX_DECODED_CHARS]


def kind_of_suffix(path: Path) -> str:
    """The kind of a file of a corpus given by path: ``.py`` code, ``.rst`` documentation, ``.txt`` prose."""
    return {".py": "code", ".rst": "documentation"}.get(path.suffix, "prose")


def find_sources(sources: Iterable[Source] = SOURCES) -> tuple[list[Source], list[Source]]:
    """(sources with at least one file installed, sources missing)."""
    found, missing = [], []
    for s in sources:
        (found if s.root.is_dir() and any(s.files()[:1]) else missing).append(s)
    return found, missing


def missing_sources_message(missing: list[Source]) -> str:
    """One line naming the missing sources and the command that installs them ('' if none)."""
    if not missing:
        return ""
    names = ", ".join(f"{s.label} ({s.kind}, {s.root})" for s in missing)
    packages = " ".join(sorted({s.package for s in missing if " " not in s.package}))
    hint = f": apt-get install {packages} installs them" if packages else ""
    return f"corpus sources not installed, left out: {names}{hint}"


def corpus_files(roots: Iterable[str | Path] | None = None, sources: Iterable[Source] | None = None) -> list[CorpusFile]:
    """Text files under ``roots`` (default: every installed source of ``SOURCES``).

    A given root is labelled by its folder name (its ``.py``, ``.txt`` and ``.rst`` files, of
    the kind ``kind_of_suffix`` says). A given root may be one such file: a corpus of that file
    alone, labelled by its name.
    """
    if roots is None:
        found = find_sources(SOURCES if sources is None else sources)[0]
        files = [f for s in found for f in s.files()]
        if not files:
            raise FileNotFoundError("no corpus source is installed: " + missing_sources_message(list(SOURCES)))
        return files
    files: list[CorpusFile] = []
    for r in roots:
        root, label = Path(r), Path(r).resolve().name
        if root.is_file():
            if root.suffix not in SUFFIXES:
                raise ValueError(f"corpus {root} is not a .py/.txt/.rst file: give such a file or a folder of them")
            files.append(CorpusFile(root, label, kind_of_suffix(root)))  # one file: a corpus of one
            continue
        if root.exists() and not root.is_dir():
            raise ValueError(f"corpus {root} is neither a file nor a folder: give a folder of .py/.txt/.rst files")
        if not root.is_dir():
            raise FileNotFoundError(f"corpus folder {root} does not exist: give a folder of .py/.txt/.rst files")
        files += _files_under(root, label)
    if not files:
        raise FileNotFoundError(f"no .py/.txt/.rst files under {[str(r) for r in roots]}")
    return files


def _files_under(root: Path, label: str) -> list[CorpusFile]:
    found = [p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()
             and "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return [CorpusFile(p, f"{label}/{p.relative_to(root).as_posix()}", kind_of_suffix(p)) for p in sorted(found)]


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files)."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def kind_sequences(files: Iterable[CorpusFile], tokenizer: Any, max_tokens: int | None = None,
                   min_tokens: int = 16) -> dict[str, list[np.ndarray]]:
    """Token ids of ``files`` by kind (in ``KINDS`` order, kinds without files left out):
    ``max_tokens`` shared equally by the kinds, and within a kind by its sources (a source
    with less text leaves the rest to the others), each source's files in the given order."""
    by_kind: dict[str, dict[str, list[CorpusFile]]] = {}
    for f in files:
        by_kind.setdefault(f.kind, {}).setdefault(f.source, []).append(f)
    kinds = [k for k in KINDS if k in by_kind] + sorted(set(by_kind) - set(KINDS))
    out: dict[str, list[np.ndarray]] = {}
    for n, kind in enumerate(kinds):
        budget = None if max_tokens is None else max_tokens // len(kinds) + (n < max_tokens % len(kinds))
        # the smallest sources first, so that what they lack goes to the larger ones
        groups = sorted(by_kind[kind].values(), key=lambda g: sum(f.path.stat().st_size for f in g))
        seqs: list[np.ndarray] = []
        for i, group in enumerate(groups):
            quota = None if budget is None else (budget - sum(s.size for s in seqs)) // (len(groups) - i)
            if quota is not None and quota <= 0:
                continue
            seqs += token_sequences(group, tokenizer, quota, min_tokens)
        out[kind] = seqs
    return out


class _TextOfHTML(HTMLParser):
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The text of an HTML page: tags dropped, scripts and styles left out, blocks on their own lines."""
    parser = _TextOfHTML()
    parser.feed(html)
    parser.close()
    return re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip() + "\n"


_ROFF_SPECIALS = {"em": "—", "en": "–", "lq": "“", "rq": "”", "oq": "‘", "cq": "’", "bu": "•", "co": "©",
                  "aq": "'", "dq": '"', "hy": "-", "mi": "-", "pl": "+", "ti": "~", "ha": "^", "rs": "\\",
                  "dg": "†", "tm": "™", "rg": "®", "<=": "≤", ">=": "≥", "mu": "×", "->": "→"}
_ROFF_ESCAPE = re.compile(r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[-+]?\d|\((..)|\[([^\]]*)\]|\*(?:\(..|\[[^\]]*\]|.)|(.))")
_ROFF_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "TH", "IP", "It", "Nm",
                     "Nd", "Sh", "Ss", "Ar", "Fl", "Xr", "Pa", "Dv", "Em", "Ql", "Dq", "Sq", "Op", "Cm", "Va", "Fn"}


def roff_text(source: str) -> str:
    """Rough plain text of a man page's roff source: comments and formatting requests dropped,
    the words of text macros (``.SH``, ``.B``, ``.IP`` ...) kept, escapes resolved."""
    lines = []
    for line in source.split("\n"):
        line = line.split('\\"', 1)[0]  # a comment
        if line.strip() in ("", ".", "'"):
            continue
        if line[:1] in (".", "'"):
            macro, _, rest = line[1:].strip().partition(" ")
            if macro not in _ROFF_TEXT_MACROS:
                continue
            line = rest.replace('"', "")
        lines.append(_ROFF_ESCAPE.sub(_roff_escape, line))
    return "\n".join(lines)


def _roff_escape(m: re.Match[str]) -> str:
    special = m.group(1) or m.group(2)
    if special is not None:
        return _ROFF_SPECIALS.get(special, "")
    char = m.group(3)
    if char is None:
        return ""  # a font, size or string escape
    return {"-": "-", "e": "\\", " ": " ", "~": " ", "|": "", "^": "", "&": "", "c": "", "0": " ",
            ",": "", "/": ""}.get(char, char)


# A file is read and tokenized at most this many characters at a time; smaller files are read
# whole and tokenized ``_BATCH_FILES`` at a time (up to ``_BATCH_CHARS``). ``max_tokens`` stops
# the reading: no more of a file (or of the corpus) is read than the tokens asked for need.
PIECE_CHARS = 1 << 20
_FIRST_PIECE_CHARS = 1 << 16
_BATCH_FILES = 64
_BATCH_CHARS = 16 << 20


def token_sequences(files: Iterable[CorpusFile], tokenizer: Any, max_tokens: int | None = None,
                    min_tokens: int = 16, *, piece_chars: int = PIECE_CHARS) -> list[np.ndarray]:
    """DeepSeek token ids (int64) of each file in order, ``max_tokens`` in all (the last file
    cut); files of fewer than ``min_tokens`` tokens are skipped.

    Memory is bounded whatever the files: a file larger than ``piece_chars`` is read and
    tokenized piece by piece (cut only between pre-tokens, so the ids equal those of the
    whole text), and reading stops once ``max_tokens`` are in hand."""
    out: list[np.ndarray] = []
    total = 0
    pending = iter(files)
    head: CorpusFile | None = next(pending, None)
    while head is not None and (max_tokens is None or total < max_tokens):
        if head.plain and _file_chars_at_most(head.path) > piece_chars:
            need = None if max_tokens is None else max(max_tokens - total, min_tokens)
            docs = [_stream_tokens(head.path, tokenizer, need, piece_chars)]
            head = next(pending, None)
        else:
            texts: list[str] = []
            size = 0
            while head is not None and len(texts) < _BATCH_FILES and size < _BATCH_CHARS \
                    and (not head.plain or _file_chars_at_most(head.path) <= piece_chars):
                texts.append(head.text())
                size += len(texts[-1])
                head = next(pending, None)
            docs = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        for ids in docs:
            total = append_capped(out, ids, total, min_tokens, max_tokens)
            if max_tokens is not None and total >= max_tokens:
                return out
    return out


def _file_chars_at_most(path: Path) -> int:
    """An upper bound of the characters of a UTF-8 file: its bytes (a bad byte reads as one U+FFFD)."""
    return path.stat().st_size


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stream_tokens(path: Path, tokenizer: Any, need: int | None, piece_chars: int) -> np.ndarray:
    """The token ids of one file read in pieces, at least ``need`` of them (all: None) where the
    file has them; the first piece is small, so a few tokens need little reading."""
    parts: list[np.ndarray] = []
    count = 0
    for piece in text_pieces(path, tokenizer, piece_chars,
                             first_chars=_FIRST_PIECE_CHARS if need is not None else piece_chars):
        ids = np.asarray(tokenizer.encode(piece, add_special_tokens=False).ids, dtype=np.int64)
        parts.append(ids)
        count += ids.size
        if need is not None and count >= need:
            break
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def text_pieces(path: Path, tokenizer: Any, piece_chars: int = PIECE_CHARS,
                first_chars: int | None = None) -> Iterator[str]:
    """The text of ``path`` (UTF-8, bad bytes replaced, universal newlines as ``read_text``) in
    pieces of at most about ``piece_chars`` characters (``first_chars`` for the first, growing),
    each cut before the second-to-last pre-token the tokenizer's pre-tokenizer finds in it:
    regex pre-tokenization looks only a character or so ahead, so the pieces' token ids
    concatenate to the whole text's. A single pre-token longer than ``4 * piece_chars``
    (a run of 4 MiB of letters) is cut where it is, to keep memory bounded."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers tokenizer's own
    pre = getattr(backend, "pre_tokenizer", None)
    size = first_chars or piece_chars
    with open(path, encoding="utf-8", errors="replace") as f:
        carry = ""
        while block := f.read(size):
            size = min(size * 4, piece_chars)
            text = carry + block
            cut = _cut(text, pre)
            if cut == 0 and len(text) < 4 * piece_chars:
                carry = text
                continue
            cut = cut or len(text)
            yield text[:cut]
            carry = text[cut:]
        if carry:
            yield carry


def _cut(text: str, pre_tokenizer: Any) -> int:
    """Where ``text`` may be cut so that what follows is pre-tokenized as in the whole text: the
    start of its second-to-last pre-token (0: no safe cut yet). Without a pre-tokenizer, after
    the last line break that is followed by more text."""
    if pre_tokenizer is None:
        return text.rfind("\n", 0, len(text) - 1) + 1
    spans = pre_tokenizer.pre_tokenize_str(text)
    return spans[-2][1][0] if len(spans) >= 3 else 0
