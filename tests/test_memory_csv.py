"""The memory CSV keeps what an earlier (resumed) run wrote, and never overwrites a foreign file."""

import csv

import pytest

from swiglu_train.memory.csv_log import MemoryCsv


def rows(path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_run_appends_after_the_rows_already_there(tmp_path):
    path = tmp_path / "memory.csv"
    first = MemoryCsv(path)
    for step in range(3):
        first.write(step, {"memory/saved_MiB": 10.0 + step})
    resumed = MemoryCsv(path)  # a new process, as a resumed fit is
    resumed.write(3, {"memory/saved_MiB": 13.0, "memory/peak_MiB": 20.0})
    resumed.write(4, {"memory/saved_MiB": 14.0, "memory/peak_MiB": 21.0})
    got = rows(path)
    assert [r["step"] for r in got] == ["0", "1", "2", "3", "4"]
    assert [r["memory/saved_MiB"] for r in got] == ["10.0", "11.0", "12.0", "13.0", "14.0"]
    assert [r["memory/peak_MiB"] for r in got] == ["", "", "", "20.0", "21.0"]


def test_steps_logged_again_after_a_checkpoint_replace_the_old_ones(tmp_path):
    """A run stopped at step 2 with its last checkpoint at step 1 resumes at step 1: the rows
    from step 1 on are logged again, once each."""
    path = tmp_path / "memory.csv"
    first = MemoryCsv(path)
    for step in range(3):
        first.write(step, {"memory/saved_MiB": 1.0})
    MemoryCsv(path).write(1, {"memory/saved_MiB": 2.0})
    assert [(r["step"], r["memory/saved_MiB"]) for r in rows(path)] == [("0", "1.0"), ("1", "2.0")]


def test_a_file_that_is_not_a_memory_csv_is_left_alone(tmp_path):
    path = tmp_path / "memory.csv"
    path.write_text("loss,lr\n1.0,0.1\n")
    with pytest.raises(ValueError, match=r"is not a memory CSV \(no 'step' column\)"):
        MemoryCsv(path).write(0, {"memory/saved_MiB": 1.0})
    assert path.read_text() == "loss,lr\n1.0,0.1\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step,memory/saved_MiB\n0,1.0,7\n", r"memory\.csv:2: the row's cells do not match"),
        ("step,memory/saved_MiB\n0,1.0\n1\n", r"memory\.csv:3: the row's cells do not match"),
        ("step,memory/saved_MiB\n0,x\n", r"memory\.csv: memory/saved_MiB = 'x' is not a number"),
        ("step,memory/saved_MiB\n", r"memory\.csv has a header but no rows"),
    ],
)
def test_a_damaged_memory_csv_is_named_with_its_row(tmp_path, text, message):
    from swiglu_train.memory.runs import load_run

    (tmp_path / "memory.csv").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_run(tmp_path / "memory.csv")


def test_a_csv_that_is_not_utf8_is_named(tmp_path):
    from swiglu_train.memory.runs import load_run

    (tmp_path / "memory.csv").write_bytes(b"step,memory/x\n0,\xff\n")
    with pytest.raises(ValueError, match=r"memory\.csv is not a readable CSV"):
        load_run(tmp_path / "memory.csv")


def test_one_label_given_to_two_runs_is_refused(tmp_path):
    from swiglu_train.memory.runs import load_runs

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        MemoryCsv(tmp_path / name / "memory.csv").write(0, {"memory/saved_MiB": 1.0})
    specs = [f"x={tmp_path / 'a' / 'memory.csv'}", f"x={tmp_path / 'b' / 'memory.csv'}"]
    with pytest.raises(ValueError, match=r"names \['x'\] more than once"):
        load_runs(specs)
