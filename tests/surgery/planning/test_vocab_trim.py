"""Vocabulary trimming (`StudentSpec(vocab_size=N)`): the kept pieces, the trimmed tokenizer, and students whose
logits are the teacher's at the kept ids, in memory, on disk and in transformers; on tiny tokenizers of both
kinds (tests/tiny_tokenizers.py) and on the real Gemma 3 270M tokenizer."""
import filecmp
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from hf_reference import (assert_clean_loading, hf_logits, load_with_info, make_hf_model, save_hf,  # noqa: E402
                          tiny_config)
from tiny_tokenizers import SAVERS, stdlib_text  # noqa: E402

from nnx_surgery.surgery import ModelConfig, load_pretrained  # noqa: E402
from nnx_surgery.surgery.pruning.in_memory import apply_plan, save_student  # noqa: E402
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError  # noqa: E402
from nnx_surgery.surgery.planning.student_planner import plan_student  # noqa: E402
from nnx_surgery.surgery.pruning.on_disk import prune_checkpoint  # noqa: E402
from nnx_surgery.surgery.plans.plan_report import format_report  # noqa: E402
from nnx_surgery.surgery.plans.student_spec import SpecError, StudentSpec  # noqa: E402
from nnx_surgery.surgery.plans.vocab_selection import TeacherTokenizer, calibration_counts, choose_vocabulary  # noqa: E402
from nnx_surgery.surgery.pruning.tokenizer_files import trimmed_tokenizer_json  # noqa: E402

CALIBRATION = ("fnmatch.py", "glob.py", "genericpath.py", "tabnanny.py")
HELD_OUT = ("posixpath.py", "copy.py")
ARBITRARY = ["Größenordnung, déjà vu — «guillemets» ¿qué? 東京は日本の首都です。 русский, العربية, 한국어",
             "Emoji: 🚀🔥👩\u200d💻 ✓ ∑ ∫ √ ≠ ≤ ½ € ¥ \u00a0nbsp \u200bzwsp",
             "SELECT name FROM users WHERE id <> 7;\n\tfn main() { println!(\"{}\", x); }\r\n",
             "a  b   c    d\t\te\n\n\nf   \n    indented\n\n\n\n\n  trailing   ",
             "<start_of_turn>user\nhi<end_of_turn> <bos> never seen: zyxwvutsrq QXJZ 1234567890", ""]
FAMILIES = [("gemma3_text", "gemma"), ("gemma2", "gemma"), ("llama", "byte_level"), ("qwen2", "byte_level")]


def _tokenizer(folder):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


def _config(family: str, vocab_size: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_config(family, vocab_size=vocab_size).to_dict())


def _lines(names) -> list[str]:
    return [line for name in names for line in stdlib_text(name).splitlines(keepends=True) if line.strip()]


def _check_trimmed(teacher_tok, student_tok, kept: list[int], texts) -> int:
    """Texts whose teacher pieces are all kept tokenize to the same pieces (mapped through `kept`); every text
    decodes back to itself. Returns how many texts were all kept."""
    exact, kept_set = 0, set(kept)
    for text in texts:
        teacher_ids = teacher_tok.encode(text, add_special_tokens=False).ids
        student_ids = student_tok.encode(text, add_special_tokens=False).ids
        if set(teacher_ids) <= kept_set:
            assert np.asarray(kept)[student_ids].tolist() == teacher_ids, text
            exact += 1
        assert teacher_tok.decode(teacher_ids, skip_special_tokens=False) == text
        assert student_tok.decode(student_ids, skip_special_tokens=False) == text, text
    return exact


# ------------------------------------------------------------------------------------------------ specs
def test_spec_vocab_size_and_text_form():
    teacher = _config("gemma3_text", 1000)
    assert StudentSpec(2, 32, 48, 4, 2, vocab_size=300).vocab_size_for(teacher) == 300
    assert StudentSpec(2, 32, 48, 4, 2, vocab_size=0.25).vocab_size_for(teacher) == 250
    assert StudentSpec(2, 32, 48, 4, 2).vocab_size_for(teacher) is None
    for bad in (0, -3, 1.5, 0.0, True, "300"):
        with pytest.raises(SpecError, match="vocab_size"):
            StudentSpec(2, 32, 48, 4, 2, vocab_size=bad)
    with pytest.raises(SpecError, match="larger than the teacher's vocab_size=1000"):
        StudentSpec(2, 32, 48, 4, 2, vocab_size=1001).check_against(teacher)
    spec = StudentSpec.from_text("layers=2,mlp=0.5,vocab=300", teacher)
    assert (spec.num_layers, spec.intermediate_size, spec.vocab_size, spec.hidden_size) == (2, 24, 300, 32)
    assert StudentSpec.from_text("vocab=0.25", teacher).vocab_size == 0.25
    assert StudentSpec.from_text("vocab=1.0", teacher).vocab_size_for(teacher) == 1000
    assert StudentSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="unknown key 'vocabulary'"):
        StudentSpec.from_text("vocabulary=300", teacher)
    with pytest.raises(SpecError, match="vocab='lots'"):
        StudentSpec.from_text("vocab=lots", teacher)


# ------------------------------------------------------------------------------------------------ tokenizers
@pytest.mark.parametrize("kind", SAVERS)
def test_kept_pieces_tokenize_exactly_and_any_text_round_trips(kind, tmp_path):
    folder = str(tmp_path / "teacher")
    size = SAVERS[kind](folder)
    teacher_tok, reader = _tokenizer(folder), TeacherTokenizer.read(folder)
    config = _config("gemma3_text" if kind == "gemma" else "llama", size)
    calibration = [stdlib_text(name) for name in CALIBRATION]
    counts = calibration_counts([np.asarray(teacher_tok.encode(t).ids) for t in calibration], size)
    _, byte_ids = reader.byte_pieces()
    specials, _ = reader.special_ids()
    for target, drops in ((size - 10, False), (450, True)):
        kept, record = choose_vocabulary(reader, config, counts, target)
        assert len(kept) == target and kept == sorted(set(kept)) and set(byte_ids) | specials <= set(kept)
        assert not {i for i, p in reader.pieces.items() if p.startswith(("<unused", "<|reserved"))} & set(kept)
        assert (record["calibration_pieces_dropped"] > 0) == drops, record
        assert kept == choose_vocabulary(reader, config, counts, target)[0]  # deterministic
        student_tok = _from_json(trimmed_tokenizer_json(reader, {t: s for s, t in enumerate(kept)}))
        assert student_tok.get_vocab_size() == target
        if not drops:  # every calibration piece is kept: the calibration text tokenizes exactly as before
            assert _check_trimmed(teacher_tok, student_tok, kept, calibration) == len(calibration)
            assert record["calibration_coverage"] == 1.0
        exact = _check_trimmed(teacher_tok, student_tok, kept, _lines(CALIBRATION + HELD_OUT) + ARBITRARY)
        assert exact > 100


def _from_json(data):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(json.dumps(data))


def test_vocabulary_needs_room_for_specials_and_bytes(tmp_path):
    folder = str(tmp_path / "teacher")
    size = SAVERS["gemma"](folder)
    counts = np.ones(size, np.int64)
    with pytest.raises(SpecError, match=r"vocab_size=100 is smaller than the 263 pieces .* use vocab_size >= 263"):
        choose_vocabulary(TeacherTokenizer.read(folder), _config("gemma3_text", size), counts, 100)
    with pytest.raises(SpecError, match="tokenizer.json: not found"):
        TeacherTokenizer.read(tmp_path)


# ------------------------------------------------------------------------------------------------ students
@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    made = {}

    def get(family: str, kind: str) -> tuple[str, int]:
        if family not in made:
            folder = str(tmp_path_factory.mktemp(f"vocab-{family}"))
            size = SAVERS[kind](folder)
            save_hf(make_hf_model(family, seed=3, vocab_size=size), folder)
            made[family] = folder, size
        return made[family]

    return get


def _calibration_rows(folder: str, length: int = 32) -> np.ndarray:
    tokenizer = _tokenizer(folder)
    ids = np.concatenate([tokenizer.encode(stdlib_text(name)).ids for name in CALIBRATION])
    return ids[:len(ids) // length * length].reshape(-1, length).astype(np.int32)


def test_compensation_is_measured_on_a_plan_that_trims_the_vocabulary(teachers):
    """measure_compensation on teacher-id calibration: measured keeping every piece (the recipe plans so)."""
    folder, _ = teachers("gemma3_text", "gemma")
    options = dict(calibration=_calibration_rows(folder), num_samples=8, source=folder, measure_compensation=True)
    teacher = load_pretrained(folder)
    trimmed = plan_student(teacher, StudentSpec(3, 24, 32, 2, 1, vocab_size=450), **options)
    untrimmed = plan_student(teacher, StudentSpec(3, 24, 32, 2, 1), **options)
    assert len(trimmed.kept_vocab) == 450 and trimmed.embed_scale != 1.0
    assert trimmed.scores["compensation"] == untrimmed.scores["compensation"]


@pytest.mark.parametrize("family,kind", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_trimmed_student_has_the_teachers_logits_at_kept_ids(family, kind, teachers, tmp_path):
    import torch
    from transformers import AutoTokenizer

    folder, size = teachers(family, kind)
    teacher = load_pretrained(folder)
    config = teacher.config
    rows = _calibration_rows(folder)
    options = dict(calibration=rows, num_samples=8, source=folder)
    vocab_only = plan_student(teacher, StudentSpec(4, 32, 48, 4, 2, vocab_size=450), **options)
    assert vocab_only.kept_vocab == choose_vocabulary(TeacherTokenizer.read(folder), config,
                                                      calibration_counts([rows], size), 450)[0]
    assert Plan.from_json(vocab_only.to_json()) == vocab_only
    assert "calibration pieces" in format_report(vocab_only)
    composed = plan_student(teacher, StudentSpec(3, 24, 32, 2, 1, vocab_size=450), **options)
    untrimmed = plan_student(teacher, StudentSpec(3, 24, 32, 2, 1), **options)
    for field in ("kept_layers", "kept_hidden", "kept_mlp", "kv_groups", "kept_heads", "embed_scale"):
        assert getattr(composed, field) == getattr(untrimmed, field), field
    kept = np.asarray(composed.kept_vocab)

    student_tok = _tokenizer_after(composed, folder)
    text = "".join(_lines(HELD_OUT))[:4000]
    ids = np.asarray(student_tok.encode(text).ids[:48], np.int32).reshape(2, 24)
    _assert_logits_at_kept_ids(apply_plan(teacher, vocab_only), teacher, ids, kept)
    small = _assert_logits_at_kept_ids(apply_plan(teacher, composed), apply_plan(teacher, untrimmed), ids, kept)

    on_disk = prune_checkpoint(folder, composed, tmp_path / "disk")
    in_memory = save_student(apply_plan(teacher, composed), composed, tmp_path / "memory", source=folder)
    names = sorted(os.listdir(on_disk))
    assert names == sorted(os.listdir(in_memory)) and "tokenizer.json" in names
    _, mismatch, errors = filecmp.cmpfiles(on_disk, in_memory, names, shallow=False)
    assert not mismatch and not errors, mismatch
    saved = ModelConfig.from_file(on_disk)
    assert saved.vocab_size == 450 and saved.raw["bos_token_id"] == int(np.flatnonzero(kept == 2)[0])
    np.testing.assert_array_equal(np.asarray(load_pretrained(on_disk)(ids).logits), small)

    hf_model, info = load_with_info(on_disk, dtype=torch.float32)
    assert_clean_loading(info)
    np.testing.assert_allclose(hf_logits(hf_model, ids), small, atol=1e-4, rtol=1e-4)
    hf_tok = AutoTokenizer.from_pretrained(on_disk)
    assert len(hf_tok) == 450 and hf_tok.bos_token_id == saved.raw["bos_token_id"]
    for line in _lines(HELD_OUT)[:200] + ARBITRARY:
        assert hf_tok(line)["input_ids"] == student_tok.encode(line).ids
        assert hf_tok.decode(hf_tok(line, add_special_tokens=False)["input_ids"]) == line
    generation = json.load(open(os.path.join(on_disk, "generation_config.json")))
    assert generation["eos_token_id"] == int(np.flatnonzero(kept == 1)[0])


def _assert_logits_at_kept_ids(trimmed, reference, ids: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """`trimmed` on student ids is `reference` on the same text in teacher ids, restricted to the kept ids: final
    hidden states bit for bit, logits bit for bit against the reference's own head rows at the kept ids, and to
    float32 rounding against its full-vocabulary logits (XLA:CPU sums a matmul in an order that depends on the
    number of output columns, so a narrower head rounds differently). Returns the trimmed logits."""
    mine, theirs = trimmed(ids, return_logits=False), reference(kept[ids], return_logits=False)
    np.testing.assert_array_equal(np.asarray(mine.final_hidden), np.asarray(theirs.final_hidden))
    logits = np.asarray(trimmed.logits_from_hidden(mine.final_hidden))
    np.testing.assert_array_equal(np.asarray(trimmed(ids).logits), logits)
    rows = reference.head_matrix()[kept]
    np.testing.assert_array_equal(logits, np.asarray(reference.logits_from_hidden(theirs.final_hidden, rows)))
    full = np.asarray(reference(kept[ids]).logits)
    np.testing.assert_allclose(logits, full[..., kept], rtol=1e-6, atol=2e-6)
    return logits


def _tokenizer_after(plan: Plan, folder: str):
    """The trimmed tokenizer (tokenizers) the plan's student gets."""
    new_id = {teacher: student for student, teacher in enumerate(plan.kept_vocab)}
    return _from_json(trimmed_tokenizer_json(TeacherTokenizer.read(folder), new_id))


def test_vocabulary_plans_are_checked(teachers, tmp_path):
    folder, size = teachers("gemma3_text", "gemma")
    teacher = load_pretrained(folder)
    rows = _calibration_rows(folder)
    with pytest.raises(SpecError, match="pass calibration="):
        plan_student(folder, StudentSpec(2, 32, 48, 4, 2, vocab_size=400), depth="uniform", width="magnitude")
    with pytest.raises(SpecError, match="pass tokenizer="):
        plan_student(teacher, StudentSpec(2, 32, 48, 4, 2, vocab_size=400), calibration=rows, num_samples=8)
    plan = plan_student(teacher, StudentSpec(2, 32, 48, 4, 2, vocab_size=400), calibration=rows, num_samples=8,
                        tokenizer=folder)
    data = plan.to_dict()
    kept = plan.kept_vocab
    edits = {"unsorted": ([kept[1], kept[0], *kept[2:]], "ascending order"),
             "duplicate": ([kept[0], *kept[:-1]], "appear more than once"),
             "out of range": ([*kept[:-1], size], "outside the teacher's range"),
             "short": (kept[:-1], "the student needs exactly 400"),
             "no bos": ([i for i in range(size) if i != 2][:400], r"lacks teacher token id\(s\) \[2\]"),
             "not ids": ("all", "list of teacher token ids")}
    for name, (value, message) in edits.items():
        with pytest.raises(PlanError, match=message):
            Plan.from_dict({**data, "kept_vocab": value})
    with pytest.raises(PlanError, match="no kept_vocab"):
        Plan.from_dict({**data, "kept_vocab": None})
    moved = {**data, "student_config": {**data["student_config"], "eos_token_id": 5}}
    with pytest.raises(PlanError, match="eos_token_id=.* is not the student id"):
        Plan.from_dict(moved)
    other = str(tmp_path / "other")
    SAVERS["gemma"](other, size=480)
    with pytest.raises(PlanError, match="not the tokenizer this plan chose its pieces from"):
        save_student(apply_plan(teacher, plan), plan, tmp_path / "student", source=other)


# ------------------------------------------------------------------------------------------------ real Gemma
@pytest.mark.slow
def test_real_gemma3_tokenizer_trimmed_to_16k_pieces_of_python(tmp_path):
    """The real Gemma 3 270M tokenizer, trimmed for Python source: exact tokenization of held-out text made of
    kept pieces, any text round-trips; prints the share of held-out tokens kept, the token count increase and the
    parameter count."""
    from tokenizers import Tokenizer

    from nnx_surgery.distill import stdlib_corpus
    from real_gemma import cached_import

    start = time.perf_counter()
    folder = cached_import("float32")
    teacher_tok, reader = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), TeacherTokenizer.read(folder)
    config = ModelConfig.from_file(folder)
    files = stdlib_corpus()
    calibration = [open(f, encoding="utf-8").read() for f in files[0::4][:150]]
    held_out = [open(f, encoding="utf-8").read() for f in files[2::4][:60]]
    counts = calibration_counts([np.asarray(e.ids) for e in teacher_tok.encode_batch(calibration)],
                                config.vocab_size)
    kept, record = choose_vocabulary(reader, config, counts, 16384)
    trimmed = trimmed_tokenizer_json(reader, {t: s for s, t in enumerate(kept)})
    student_tok = _from_json(trimmed)
    assert len(kept) == 16384 and all(i in kept for i in (0, 1, 2, 3, 105, 106))  # pad eos bos unk turn markers

    teacher_ids = [e.ids for e in teacher_tok.encode_batch(held_out, add_special_tokens=False)]
    student_ids = [e.ids for e in student_tok.encode_batch(held_out, add_special_tokens=False)]
    kept_set = set(kept)
    survived = sum(sum(i in kept_set for i in ids) for ids in teacher_ids) / sum(map(len, teacher_ids))
    held_bytes = sum(len(t.encode("utf-8")) for t in held_out)
    increase = sum(map(len, student_ids)) / sum(map(len, teacher_ids)) - 1
    exact = _check_trimmed(teacher_tok, student_tok, kept, _lines_of(held_out[:20]) + ARBITRARY)
    assert exact > 1000 and survived > 0.9
    for text, ids in zip(held_out, student_ids):
        assert student_tok.decode(ids, skip_special_tokens=False) == text
    _check_transformers_loads(trimmed, folder, tmp_path, student_tok, held_out[:5] + ARBITRARY)
    parameters = (config.num_parameters(), config.replace(vocab_size=16384).num_parameters())
    print(f"\nreal Gemma 3 270M tokenizer -> 16,384 pieces ({time.perf_counter() - start:.0f} s): {record}\n"
          f"  held-out stdlib tokens whose piece survives: {100 * survived:.2f}%; tokens per byte "
          f"{sum(map(len, teacher_ids)) / held_bytes:.4f} -> {sum(map(len, student_ids)) / held_bytes:.4f} "
          f"(+{100 * increase:.2f}%); parameters {parameters[0]:,} -> {parameters[1]:,}")


def _check_transformers_loads(data, teacher_folder, folder, student_tok, texts) -> None:
    """transformers' GemmaTokenizer (which rebuilds its pipeline from the file's vocabulary and merges) gives the
    trimmed tokenizer's ids."""
    import shutil

    from transformers import AutoTokenizer

    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(os.path.join(teacher_folder, name), os.path.join(folder, name))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert type(loaded).__name__ == "GemmaTokenizer" and len(loaded) == student_tok.get_vocab_size()
    for text in texts:
        assert loaded(text)["input_ids"] == student_tok.encode(text).ids


def _lines_of(texts) -> list[str]:
    return [line for text in texts for line in text.splitlines(keepends=True) if line.strip()]


def test_vocabulary_can_be_counted_on_more_rows_than_the_model_passes_score(teachers):
    """vocab_calibration: the kept pieces follow its counts (as if it were the calibration), while the importance
    scores and the widths stay those of `calibration` (the recipe counts the whole corpus, scores a few rows)."""
    folder, _ = teachers("gemma3_text", "gemma")
    teacher, rows = load_pretrained(folder), _calibration_rows(folder)
    spec, few = StudentSpec(3, 24, 32, 2, 1, vocab_size=450), rows[:4]
    both = plan_student(teacher, spec, calibration=few, vocab_calibration=rows, tokenizer=folder)
    counted_all = plan_student(teacher, spec, calibration=rows, tokenizer=folder)
    few_only = plan_student(teacher, spec, calibration=few, tokenizer=folder)
    assert both.kept_vocab == counted_all.kept_vocab != few_only.kept_vocab
    assert both.scores["vocab"] == counted_all.scores["vocab"]
    assert (both.kept_layers, both.kept_hidden, both.kept_mlp) == \
        (few_only.kept_layers, few_only.kept_hidden, few_only.kept_mlp)
    def without_vocab(plan):
        return {name: value for name, value in plan.scores.items() if name != "vocab"}

    assert without_vocab(both) == without_vocab(few_only) != without_vocab(counted_all)
