"""py-spy's raw stacks read back as frame shares, and a real sampled process."""

import shutil
import subprocess
import sys
import textwrap

import pytest

from swiglu_train.bench.e2e.host_samples import sampled, top_frames

RAW = textwrap.dedent(
    """\
    process 7:"python -c
    import x" 3
    process 7:"python -c
    import x";<module> (<string>:2);loop (<string>:5);work (<string>:9) 6
    process 7:"python -c
    import x";<module> (<string>:2);loop (<string>:6);loop (<string>:7) 1
    process 8:"torchrun run.py";main (run.py:10);wait (threading.py:320) 2
    """
)


def test_frames_are_counted_once_per_sample_and_lines_merge(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    got = top_frames(path)
    assert got["samples"] == 12
    shares = {f["frame"]: f["share"] for f in got["frames"]}
    # the recursion-like loop (two lines of one function) counts once per sample
    assert shares == {
        "<module> (<string>)": 7 / 12,
        "loop (<string>)": 7 / 12,
        "work (<string>)": 6 / 12,
        "main (run.py)": 2 / 12,
        "wait (threading.py)": 2 / 12,
    }
    # self shares: the innermost frame of each sample (the process-name-only sample has none)
    assert {f["frame"]: f["share"] for f in got["leaves"]} == {
        "work (<string>)": 6 / 12,
        "loop (<string>)": 1 / 12,
        "wait (threading.py)": 2 / 12,
    }
    assert {f["frame"] for f in top_frames(path, top=2)["frames"]} == {
        "<module> (<string>)",
        "loop (<string>)",
    }


def test_samples_within_a_function(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    got = top_frames(path, within="loop")
    assert got["samples"] == 7
    assert {f["frame"]: f["share"] for f in got["frames"]} == {  # its callers left out
        "loop (<string>)": 1.0,
        "work (<string>)": 6 / 7,
    }
    assert top_frames(path, within="lo")["samples"] == 0  # whole names only


def test_no_samples_gives_no_frames(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text("")
    assert top_frames(path) == {"samples": 0, "frames": [], "leaves": []}


def test_without_py_spy_sampling_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ValueError, match=r"needs py-spy, on PATH or in .*: pip install py-spy"):
        sampled(["true"], tmp_path / "raw.txt")


def test_native_frames_are_asked_for_only_when_wanted(monkeypatch, tmp_path):
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    plain, native = (sampled(["true"], tmp_path / "raw.txt", native=n) for n in (False, True))
    assert "--native" not in plain
    assert native.index("--native") < native.index("--")  # py-spy's option, not the command's
    assert [arg for arg in native if arg != "--native"] == plain


def test_py_spy_beside_an_unactivated_venv_s_python_is_found(monkeypatch, tmp_path):
    spy = tmp_path / "venv" / "py-spy"
    spy.parent.mkdir()
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    assert sampled(["true"], tmp_path / "raw.txt")[0] == str(spy)


def test_a_sampled_process_shows_its_busy_function(tmp_path):
    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (the test extra installs it)")
    script = tmp_path / "busy.py"
    script.write_text(
        "import time\n"
        "def spin_for_the_sampler():\n"
        "    end = time.perf_counter() + 2.0\n"
        "    while time.perf_counter() < end:\n"
        "        sum(range(1000))\n"
        "spin_for_the_sampler()\n"
    )
    path = tmp_path / "raw.txt"
    done = subprocess.run(sampled([sys.executable, str(script)], path), capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = top_frames(path)
    assert got["samples"] >= 100  # 100 a second for about two seconds
    shares = {f["frame"]: f["share"] for f in got["frames"]}
    # on most samples' stacks (py-spy names files by base name): the interpreter's start-up,
    # sampled too, takes longer on a loaded CI machine (47 % of a one-second spin's samples)
    assert shares["spin_for_the_sampler (busy.py)"] > 0.6
