"""Question loading, validation and deterministic per-category selection."""
import pytest

from polybasic.bench.questions import DEFAULT_QUESTIONS, UNCATEGORIZED, Question, load_questions, select
from polybasic.errors import ConfigError
from tests.bench.conftest import write_questions


def test_loads_first_turn_only(questions_file):
    qs = load_questions(questions_file)
    assert len(qs) == 6
    assert qs[0] == Question(0, "writing", qs[0].prompt) and "second" not in qs[0].prompt


def test_default_is_the_shipped_spec_bench(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any folder: the questions are package data
    assert DEFAULT_QUESTIONS == "spec-bench"
    qs = load_questions()
    assert load_questions("spec-bench") == qs
    assert len(qs) == 480 and len({q.category for q in qs}) == 13


@pytest.mark.parametrize("line, words", [
    ("{not json", "not valid JSON"),
    ('{"category": "a", "turns": ["x"]}', "lacks a field"),
    ('{"question_id": 1, "category": "a"}', "lacks a field"),
    ('{"question_id": 1, "category": "a", "turns": []}', "'turns' must be"),
    ('{"question_id": 1, "category": 5, "turns": ["x"]}', "'category' must be a string"),
    ('[1, 2]', "lacks a field"),
])
def test_malformed_lines_name_line_and_schema(tmp_path, line, words):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question_id": 0, "category": "a", "turns": ["ok"]}\n' + line + "\n")
    with pytest.raises(ConfigError, match="line 2") as e:
        load_questions(p)
    assert words in str(e.value) and '"question_id", "category", "turns"' in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*question_id"):
        load_questions(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no questions"):
        load_questions(tmp_path / "empty.jsonl")


def test_select_per_category_is_deterministic_and_grouped(questions_file):
    qs = load_questions(questions_file)
    picked = select(qs, per_category=2)
    assert [(q.category, q.question_id) for q in picked] == [
        ("writing", 0), ("writing", 1), ("qa", 2), ("qa", 4), ("math", 3)]
    assert select(qs, per_category=2) == picked
    assert select(qs) == [q for c in ("writing", "qa", "math") for q in qs if q.category == c]


def test_select_categories(questions_file):
    qs = load_questions(questions_file)
    assert [q.question_id for q in select(qs, 1, ["math", "qa"])] == [2, 3]  # file order of categories
    with pytest.raises(ConfigError, match="unknown nope; the file has writing, qa, math"):
        select(qs, 1, ["nope"])
    with pytest.raises(ConfigError, match="per_category"):
        select(qs, 0)


def test_accepts_string_ids(tmp_path):
    p = write_questions(tmp_path / "q.jsonl", [{"question_id": "a-1", "category": "c", "turns": ["hi"]}])
    assert load_questions(p)[0].question_id == "a-1"


def test_missing_or_empty_category_is_one_category(tmp_path):
    """Public question sets without categories load as one category, which select keeps whole."""
    p = write_questions(tmp_path / "flat.jsonl", [{"question_id": 0, "turns": ["a"]},
                                                  {"question_id": 1, "category": "", "turns": ["b"]},
                                                  {"question_id": 2, "category": None, "turns": ["c"]}])
    qs = load_questions(p)
    assert [(q.question_id, q.category, q.prompt) for q in qs] == [
        (0, UNCATEGORIZED, "a"), (1, UNCATEGORIZED, "b"), (2, UNCATEGORIZED, "c")]
    assert select(qs, per_category=2) == qs[:2]
    assert select(qs, categories=[UNCATEGORIZED]) == qs
