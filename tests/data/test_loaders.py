"""load_rows (jsonl/json/parquet, renames, row-level errors) and the built-in GSM8K-style rows."""

import json

import pytest

from rlbolt.data import DataFileError, gsm8k_style_rows, load_rows
from rlbolt.rewards import extract_answer, gsm8k_reward

ROWS = [{"problem": "1 + 1?", "solution": "#### 2"}, {"problem": "2 * 3?", "solution": "#### 6", "id": 7}]


def test_jsonl_with_rename_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = load_rows(path, required=("question", "answer"), rename={"problem": "question", "solution": "answer"})
    assert rows == [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 * 3?", "answer": "#### 6", "id": 7}]
    assert load_rows(path, limit=1) == [ROWS[0]]


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))
    assert load_rows(path) == ROWS


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2"}]), path)
    assert load_rows(path, required=("question",)) == [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2"}]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataFileError, match=r"bad.jsonl line 2: not valid JSON"):
        load_rows(path)
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataFileError, match=r"line 2: expected a JSON object"):
        load_rows(path)


def test_missing_field_names_line_and_present_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n" + json.dumps({"question": "b"}) + "\n")
    with pytest.raises(DataFileError) as err:
        load_rows(path, required=("question", "answer"))
    msg = str(err.value)
    assert "line 2" in msg and "['answer']" in msg and "['question']" in msg and "data.answer_field" in msg


def test_missing_file_bad_suffix_and_empty(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataFileError, match=r"suffix '.csv'.*\.parquet"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataFileError, match="holds no rows"):
        load_rows(tmp_path / "e.jsonl")


def test_builtin_rows_are_seeded_prefix_stable_and_correct():
    rows = gsm8k_style_rows(40, seed=3)
    assert rows == gsm8k_style_rows(40, seed=3)
    assert rows[:10] == gsm8k_style_rows(10, seed=3)
    assert rows != gsm8k_style_rows(40, seed=4)
    for row in rows:
        # The worked steps are real arithmetic: evaluate each "x op y = z" and check the final answer.
        steps, final = row["answer"].split("\n#### ")
        for step in steps.split(", "):
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307 - our own generated digits and operators
        assert int(final) == int(steps.split(" = ")[-1]) >= 0
        assert extract_answer(row["answer"]) == final
        assert gsm8k_reward(f"so the answer is {final}", row) == 1.0
        assert all(32 <= ord(ch) < 127 or ch == "\n" for ch in row["question"] + row["answer"])
