"""Corpus readers: files (plain text, WikiText, JSONL) and the embedded default corpus, as documents.

A *document* is a ``list[str]`` of sentences, the unit BERT's sample builder works on: sentence
pairs for next-sentence prediction come from within one document, and sequences are packed from
consecutive sentences of one document.

Formats (``format=``):

``"text"``
    Plain text in the layout of BERT's ``create_pretraining_data.py``: blank lines separate
    documents; every non-blank line is a paragraph (one sentence per line is the common case) and
    is split further by :func:`split_sentences`.
``"wikitext"``
    The WikiText-2/103 raw layout. A top-level heading `` = Title = `` (exactly one ``=`` on each
    side) starts a new document. Headings are dropped, sub-headings (`` = = Section = = ``) too:
    they are labels, not sentences, and a heading in a sentence pair teaches the model nothing
    about the next sentence. The tokenised-number joiners ``@-@``, ``@,@`` and ``@.@`` are undone
    (``0 @.@ 7`` -> ``0.7``, ``state @-@ of`` -> ``state-of``); the rest of WikiText's
    space-separated punctuation and its ``<unk>`` markers are kept as they are.
``"jsonl"``
    One JSON object per line, the text in ``field`` (default ``"text"``); newlines in the text
    separate paragraphs. Blank lines are skipped; a line that is not a JSON object with a string
    ``field`` is an error naming ``file:line``.
``"auto"``
    ``.jsonl``/``.ndjson``/``.json`` -> jsonl; otherwise the first 64 KiB decide: a first non-blank
    line starting with ``{`` -> jsonl, a raw WikiText title line (`` = Title = `` with the
    surrounding spaces) -> wikitext, else text.

Files ending in ``.gz``, ``.bz2`` or ``.xz`` are decompressed on the fly. Inputs may be files,
directories (every non-hidden file below them, sorted) and glob patterns (``**`` recursive,
sorted); a missing path, an empty directory or a pattern matching nothing is a
:class:`~vrgd_ds.data_pipeline.errors.DataError`, and so is a corpus that yields no document at all.

The embedded corpus (:func:`embedded_corpus`) is the documentation that ships inside the
interpreter, so the pretraining job runs on a machine without any download: the ``pydoc_data``
topics (the language reference pages behind ``help("topics")``) and the docstrings of the standard
library's public modules, functions, classes and methods (those defined in the standard library:
not a method another package sets on a stdlib class, so the text does not depend on what the
process imported). Measured on CPython 3.11.7 (Linux), 2026-12-04:
1.6 MB of text (0.47 MB of it pydoc topics) in 1,492 documents and 18,768 sentences, collected
in about 0.5 s; about 360k tokens with an 8k-piece vocabulary. That is small next to
Wikipedia (a unigram model on it supports at most about 10.8k pieces), but enough for the job
to run end to end, and to overfit visibly, on a fresh machine.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import importlib
import inspect
import io
import json
import logging
import lzma
import os
import pkgutil
import re
import sys
import unicodedata
import warnings
import zlib
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import TextIO, Union

from vrgd_ds.data_pipeline.errors import DataError

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
FORMATS = ("auto", "text", "wikitext", "jsonl")
Document = list[str]

# --------------------------------------------------------------------------- sentence splitting

# A boundary candidate: terminal punctuation, optional closing quotes/brackets, whitespace, and a
# word character after an optional opening quote/bracket; ``_starts_sentence`` keeps those whose
# character is a capital or a digit in any script ("Über", "Émile", "Было", "٣"). Lower-case
# continuations ("e.g. the", "H. americanus") are never split.
_CLOSING = "\"'\u201d\u2019\u201c\u2018\u00bb\u203a)]"  # " ' ” ’, German “ ‘, French » ›, brackets
_OPENING = "\"'\u201c\u2018\u201e\u201a\u00ab\u2039(["  # " ' “ ‘, German „ ‚, French « ‹, brackets
_BOUNDARY = re.compile(rf"""[.!?]+[{re.escape(_CLOSING)}]*\s+(?=[{re.escape(_OPENING)}]?(\w))""")
# Words whose trailing period is an abbreviation, not a sentence end (compared lower-cased,
# without the period).
_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al mr mrs ms dr prof st jr sr no nos fig figs vol eq eqs approx ca "
    "inc ltd co corp dept est jan feb mar apr jun jul aug sep sept oct nov dec gen col lt sgt "
    "capt rev hon mt ft".split()
)
# "U.S", "e.g" and single initials ("J" in "J. Smith", "É" in "É. Zola") also end in a
# non-terminal period.
_DOTTED = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")


def _starts_sentence(char: str) -> bool:
    """A capital (upper or title case) or a decimal digit, in any script."""
    return char.isupper() or char.istitle() or char.isdecimal()


def _initial(word: str) -> bool:
    """A single capital, composed or not ("É" as one code point or as "E" and a combining accent)."""
    word = unicodedata.normalize("NFC", word)
    return len(word) == 1 and _starts_sentence(word) and not word.isdecimal()


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with a regex rule; whitespace runs become single spaces.

    A sentence ends at ``.``, ``!`` or ``?`` (plus closing quotes/brackets) followed by whitespace
    and an upper-case letter or a digit of any script, or an opening quote/bracket before one -
    unless the word before a ``.`` is a known abbreviation (``e.g.``, ``Dr.``, ``Fig.`` ...), a
    dotted acronym (``U.S.``) or a single capital initial. Scripts without case (CJK, Arabic,
    Devanagari) have no boundary by this rule but at a digit. This is the rule of thumb of Punkt-style splitters
    without the trained model: good enough for packing BERT sequences, where a wrong boundary
    costs one slightly odd next-sentence pair, and it needs no nltk download.
    """
    text = " ".join(text.split())
    if not text:
        return []
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if not _starts_sentence(match.group(1)):
            continue
        if text[match.start()] == "." and match.group().startswith(".") and not match.group().startswith(".."):
            word = text[start:match.start()].rsplit(" ", 1)[-1].lstrip(_OPENING)
            if word.lower() in _ABBREVIATIONS or _DOTTED.fullmatch(word) or _initial(word):
                continue
        end = match.start() + len(match.group().rstrip())
        sentences.append(text[start:end])
        start = match.end()
    if start < len(text):
        sentences.append(text[start:])
    return sentences


def _paragraph_sentences(text: str) -> list[str]:
    """Sentences of a multi-line text whose paragraphs are separated by blank lines."""
    sentences: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        sentences.extend(split_sentences(paragraph))
    return sentences


# --------------------------------------------------------------------------- file formats

_TITLE = re.compile(r"= (?!=)(.*\S)(?<!=) =")  # on the stripped line: "= Title =", not "= = Sub = ="
_SUBHEADING = re.compile(r"(?:= ){2,}.*(?: =){2,}")
_RAW_TITLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)  # the raw file: " = Title = " with spaces
_JOINER = re.compile(r"\s*@([-,.])@\s*")


def _text_documents(path: Path, lines: Iterable[str]) -> Iterator[Document]:
    document: Document = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            if document:
                yield document
                document = []
            continue
        document.extend(split_sentences(stripped))
    if document:
        yield document


def _wikitext_documents(path: Path, lines: Iterable[str]) -> Iterator[Document]:
    document: Document = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue  # WikiText puts blank lines around every heading and paragraph
        if _TITLE.fullmatch(stripped):
            if document:
                yield document
            document = []
            continue
        if _SUBHEADING.fullmatch(stripped):
            continue
        document.extend(split_sentences(_JOINER.sub(r"\1", stripped)))
    if document:
        yield document


def _jsonl_documents(path: Path, lines: Iterable[str], field: str) -> Iterator[Document]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                "fix or delete that line (JSONL needs one JSON object per line)"
            ) from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{lineno}: no {field!r} field (found {keys}); "
                "pass the name of the text field with field= / --field"
            )
        text = record[field]
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{lineno}: field {field!r} is a {type(text).__name__}, not a string; "
                "pass the name of the text field with field= / --field"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # an escaped half of a surrogate pair, e.g. "\ud800": valid JSON, not text
            raise DataError(
                f"{path}:{lineno}: field {field!r} holds an unpaired surrogate ({text[e.start]!r} at character "
                f"{e.start}), which is not text; fix that line (a pair written as two escapes is fine)"
            ) from None
        document = [s for paragraph in text.splitlines() for s in split_sentences(paragraph)]
        if document:
            yield document


_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
#: what a truncated or corrupt compressed file raises while it is read (gzip's BadGzipFile is an
#: OSError: an OSError counts as one only from a compressed file, see ``_corrupt``)
_CORRUPT = (EOFError, lzma.LZMAError, zlib.error, OSError)


def _corrupt(path: Path, e: BaseException) -> bool:
    return not isinstance(e, OSError) or (path.suffix.lower() in _OPENERS and not isinstance(
        e, (FileNotFoundError, PermissionError, IsADirectoryError)))


def _open_text(path: Path) -> TextIO:
    opener = _OPENERS.get(path.suffix.lower())
    if opener is not None:
        return io.TextIOWrapper(opener(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")  # a byte-order mark is not text


def _undecodable_line(path: Path) -> int | None:
    """The first line of ``path`` that is not UTF-8 (1-based; None if every line is). The text
    reader decodes blocks ahead of the line it yields, so its position does not say where the bad
    byte is; no UTF-8 character holds a newline byte, so each line decodes on its own."""
    opener = _OPENERS.get(path.suffix.lower(), open)
    with opener(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return lineno
    return None


def _unreadable(path: Path, e: OSError, line: int | None = None) -> DataError:
    """The error of an input that cannot be opened or read (gone, no permission, a directory, an
    I/O error), naming it, and the line where the reading stopped when that is known."""
    where = f"{path}:{line}" if line is not None else str(path)
    gone = " (moved or deleted since the inputs were listed?)" if isinstance(e, FileNotFoundError) else ""
    return DataError(f"{where}: the input cannot be read ({type(e).__name__}: {e.strerror or e}){gone}; check that "
                     "the file is there and readable, or leave it out of the inputs")


def _not_utf8(path: Path) -> DataError:
    line = _undecodable_line(path)
    where = f"{path}:{line}" if line is not None else str(path)
    return DataError(f"{where}: not UTF-8 text; convert the file to UTF-8 or leave it out of the inputs")


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


#: characters ``detect_format`` reads of a file
HEAD_CHARS = 1 << 16


def detect_format(path: PathLike) -> str:
    """``"jsonl"``, ``"wikitext"`` or ``"text"`` for ``path``, by extension, then by content."""
    path = Path(path)
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _OPENERS:
        suffixes.pop()
    if suffixes and suffixes[-1] in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    try:
        with _open_text(path) as fh:
            head = fh.read(HEAD_CHARS)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    except _CORRUPT as e:
        if not _corrupt(path, e):
            raise _unreadable(path, e) from e
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {e}); a truncated or corrupt "
                        "compressed file? Fetch it again or leave it out of the inputs") from None
    lines = head.split("\n")  # as the JSONL reader splits (not splitlines: U+2028 may sit inside a record)
    at = next((i for i, line in enumerate(lines) if line.strip()), None)
    first = "" if at is None else lines[at]
    whole = at is not None and (at < len(lines) - 1 or len(head) < HEAD_CHARS)  # the line ends within the head
    if first.lstrip().startswith("{") and (not whole or _json_object(first)):
        return "jsonl"  # a record longer than the head is taken for one; wiki markup ("{{Infobox") is text
    if _RAW_TITLE.search(head):
        return "wikitext"
    return "text"


def resolve_inputs(inputs: PathLike | Iterable[PathLike]) -> list[Path]:
    """Expand files, directories and glob patterns to a sorted, de-duplicated list of files.

    Order: inputs in the order given; within a directory or pattern, sorted by path, so the
    corpus (and everything built from it) is the same on every machine. A file or directory that
    exists is taken as named, even where its name holds glob characters (``wiki[2023].txt``):
    only a path that names nothing is a pattern.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: list[Path] = []
    for entry in inputs:
        text = os.path.expanduser(os.fspath(entry))
        if glob.has_magic(text) and not os.path.exists(text):
            matched = sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataError(
                    f"input pattern {text!r} matches no files; check the pattern "
                    "(quote it so that the shell does not expand it first)"
                )
            files.extend(matched)
        elif os.path.isdir(text):
            matched = sorted(
                p for p in Path(text).rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(text).parts)
            )
            if not matched:
                raise DataError(f"input directory {text} contains no files; point the inputs at the corpus files")
            files.extend(matched)
        elif os.path.isfile(text):
            files.append(Path(text))
        else:
            raise DataError(f"input {text} does not exist; check the path (inputs are files, directories or glob patterns)")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def read_file(path: PathLike, format: str = "auto", field: str = "text") -> Iterator[Document]:
    """Documents of one file; ``format`` as in the module docstring."""
    path = Path(path)
    if format not in FORMATS:
        raise DataError(f"unknown corpus format {format!r}; use one of {', '.join(FORMATS)}")
    if format == "auto":
        format = detect_format(path)
        logger.debug("%s: detected format %s", path, format)
    try:
        fh = _open_text(path)  # opens only: a compressed file's header is read with the first line
    except OSError as e:
        raise _unreadable(path, e) from e
    with fh:
        lineno = 0

        def counted() -> Iterator[str]:
            nonlocal lineno
            for lineno, line in enumerate(fh, 1):  # noqa: B007 - read back in the error message
                yield line.removeprefix("\ufeff")  # another file's byte-order mark, where files were joined by cat

        try:
            if format == "jsonl":
                yield from _jsonl_documents(path, counted(), field)
            elif format == "wikitext":
                yield from _wikitext_documents(path, counted())
            else:
                yield from _text_documents(path, counted())
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        except _CORRUPT as e:
            if not _corrupt(path, e):
                raise _unreadable(path, e, lineno + 1) from e
            raise DataError(f"{path}:{lineno + 1}: cannot be read ({type(e).__name__}: {e}); a truncated or "
                            "corrupt compressed file? Fetch it again or leave it out of the inputs") from None


class Corpus:
    """A re-iterable corpus over files: every ``iter()`` reads the files again from the start.

    Tokenizer training and sharding each take one pass, so the corpus is never held in memory.

    Args:
        inputs: files, directories or glob patterns (see :func:`resolve_inputs`).
        format: ``"auto"``, ``"text"``, ``"wikitext"`` or ``"jsonl"``, for every file.
        field: the text field of JSONL records.
    """

    def __init__(self, inputs: PathLike | Iterable[PathLike], format: str = "auto", field: str = "text"):
        if format not in FORMATS:
            raise DataError(f"unknown corpus format {format!r}; use one of {', '.join(FORMATS)}")
        self.files = resolve_inputs(inputs)
        self.format = format
        self.field = field

    @property
    def description(self) -> str:
        """What the corpus is, for manifests and logs."""
        names = ", ".join(str(f) for f in self.files[:5])
        more = f" and {len(self.files) - 5} more" if len(self.files) > 5 else ""
        return f"{self.format} files: {names}{more}"

    @property
    def num_bytes(self) -> int:
        """Size of the input files on disk (compressed size for compressed files)."""
        return sum(f.stat().st_size for f in self.files)

    def __iter__(self) -> Iterator[Document]:
        count = 0
        for path in self.files:
            for document in read_file(path, self.format, self.field):
                count += 1
                yield document
        if count == 0:
            raise DataError(
                f"the corpus ({self.description}) has no documents: the files are empty or hold only "
                "blank lines/headings; check the paths and the format (--format)"
            )


def read_documents(inputs: PathLike | Iterable[PathLike], format: str = "auto", field: str = "text") -> Iterator[Document]:
    """Documents of all ``inputs`` in order; paths and format are checked before the first read."""
    return iter(Corpus(inputs, format, field))


# --------------------------------------------------------------------------- embedded corpus

# Modules not imported for the embedded corpus, and why: antigravity opens a web browser, this
# prints the Zen of Python; readline/rlcompleter change the terminal's line editing on import;
# idlelib/turtle/turtledemo/tkinter need a display to be useful and turtle reads turtle.cfg from
# the working directory (a corpus that depends on the cwd would not be deterministic); test and
# lib2to3 are test suites and a deprecated grammar toolkit, not documentation; pydoc_data is read
# directly.
_SKIP_MODULES = frozenset(
    "antigravity this readline rlcompleter idlelib turtle turtledemo tkinter test lib2to3 pydoc_data".split()
)
# Sub-packages whose modules are data, not documentation (hundreds of codec tables).
_SKIP_SUBMODULES_OF = frozenset({"encodings"})
_RULE_LINE = re.compile(r"^\s*[*=~^\-+#]{3,}\s*$", re.MULTILINE)  # reST underlines in pydoc topics
_DOCTEST_LINE = re.compile(r"^\s*(?:>>>|\.\.\.)(?:\s.*)?$", re.MULTILINE)


def _public(name: str) -> bool:
    return not name.startswith("_") and not name.startswith("test") and name != "idle_test"


def _stdlib_module_names() -> list[str]:
    """Public top-level stdlib modules and their public submodules, sorted."""
    names = []
    for top in sorted(sys.stdlib_module_names):
        if not _public(top) or top in _SKIP_MODULES:
            continue
        names.append(top)
        module = _import(top)
        if module is None or not hasattr(module, "__path__") or top in _SKIP_SUBMODULES_OF:
            continue
        # walk_packages imports packages to find their children; onerror keeps going past
        # sub-packages that fail to import on this platform (asyncio.windows_events, ...).
        for info in pkgutil.walk_packages(module.__path__, prefix=top + ".", onerror=lambda name: None):
            if all(_public(part) for part in info.name.split(".")[1:]):
                names.append(info.name)
    return sorted(set(names))


def _import(name: str):
    """The module, or None when it cannot be imported here (platform-specific, missing C library)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated modules warn on import
            return importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - SystemExit/ImportError/OSError: skip that module
        if isinstance(e, KeyboardInterrupt):
            raise
        logger.debug("embedded corpus: skipping %s (%s: %s)", name, type(e).__name__, e)
        return None


def _own_doc(obj) -> str | None:
    """The docstring defined on ``obj`` itself (not inherited), cleaned of indentation and doctests."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    return _DOCTEST_LINE.sub("", inspect.cleandoc(doc))


def _from_elsewhere(member) -> bool:
    """Whether ``member`` was defined outside the standard library: a method another package set
    on a stdlib class when imported (``transformers`` adds ``logging.Logger.warning_once``), which
    would make the corpus depend on what the process imported first."""
    module = getattr(member.fget if isinstance(member, property) else member, "__module__", None)
    return isinstance(module, str) and module.partition(".")[0] not in sys.stdlib_module_names


def _method_docs(cls: type) -> list[str]:
    docs = []
    for name, member in sorted(cls.__dict__.items()):
        if not _public(name):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if (callable(member) or isinstance(member, property)) and not _from_elsewhere(member):
            doc = _own_doc(member)
            if doc:
                docs.append(doc)
    return docs


def _collect_embedded() -> tuple[tuple[str, ...], ...]:
    documents: list[tuple[str, ...]] = []
    seen: set[str] = set()  # docstrings shared by aliases and re-exports count once

    def add(texts: list[str]) -> None:
        sentences: list[str] = []
        for text in texts:
            if text in seen:
                continue
            seen.add(text)
            sentences.extend(_paragraph_sentences(_RULE_LINE.sub("", text)))
        if sentences:
            documents.append(tuple(sentences))

    from pydoc_data.topics import topics

    for key in sorted(topics):
        add([topics[key]])
    for name in _stdlib_module_names():
        module = _import(name)
        if module is None:
            continue
        functions, classes = [], []
        for attr, obj in sorted(vars(module).items()):
            if not _public(attr) or getattr(obj, "__module__", None) != name:
                continue  # re-exported objects are documented where they are defined
            if isinstance(obj, type):
                classes.append(obj)
            elif callable(obj):
                doc = _own_doc(obj)
                if doc:
                    functions.append(doc)
        module_doc = _own_doc(module)
        add(([module_doc] if module_doc else []) + functions)
        for cls in classes:
            class_doc = _own_doc(cls)
            add(([class_doc] if class_doc else []) + _method_docs(cls))
    return tuple(documents)


@lru_cache(maxsize=1)
def _embedded() -> tuple[tuple[str, ...], ...]:
    documents = _collect_embedded()
    logger.info(
        "embedded corpus: %d documents, %.1f MB (Python %s)",
        len(documents), sum(len(s.encode()) + 1 for d in documents for s in d) / 1e6, sys.version.split()[0],
    )
    return documents


def embedded_corpus() -> list[Document]:
    """The default corpus: ``pydoc_data`` topics plus standard-library docstrings, as documents.

    Documents, in this order: one per ``pydoc_data.topics`` entry (sorted by topic); then, for
    every public stdlib module and public submodule (``sys.stdlib_module_names``, sorted, minus
    the modules listed in ``_SKIP_MODULES`` and the codec tables under ``encodings``), one
    document of the module docstring followed by the docstrings of the module's own public
    functions, and one document per public class defined there (the class docstring followed by
    its own public methods' and properties' docstrings). Members are visited in name order;
    objects re-exported from another module are left to that module, and a docstring already
    used (inherited aliases, shared C docstrings) is not repeated. Modules that cannot be
    imported on this platform are skipped. Deterministic for a given interpreter build; the size
    is in the module docstring.

    Importing the modules leaves them in ``sys.modules`` of the calling process. The result is
    computed once per process.
    """
    return [list(d) for d in _embedded()]


EMBEDDED_DESCRIPTION = f"embedded: pydoc_data topics + stdlib docstrings (Python {sys.version.split()[0]})"


class EmbeddedCorpus:
    """:func:`embedded_corpus` behind the :class:`Corpus` interface (re-iterable, described)."""

    format = "embedded"
    files: list[Path] = []
    description = EMBEDDED_DESCRIPTION

    @property
    def num_bytes(self) -> int:
        return sum(len(s.encode()) + 1 for d in _embedded() for s in d)

    def __iter__(self) -> Iterator[Document]:
        return (list(d) for d in _embedded())
