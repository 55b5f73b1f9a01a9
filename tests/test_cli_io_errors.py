"""The CLI reports a file it cannot read or write (OSError) in one line naming the path and the
cause, and a checkpoint damaged on its way as damaged, saying what was expected and found."""

import errno
import io
import os
import resource
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import swiglu_train.files
from swiglu_train import ParMLP
from swiglu_train.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEBUG_ENV = "SWIGLU_TRAIN_DEBUG"
CONVERT = ("convert", "--to", "canonical", "--assume-layout", "canonical")


@pytest.fixture
def entry(monkeypatch, capsys):
    """Run ``swiglu-train ARGS`` through the console-script entry point; (exit code, stderr)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def run(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            app(args=list(args), prog_name="swiglu-train")
        return exit_.value.code, capsys.readouterr().err

    return run


@pytest.fixture
def checkpoint(tmp_path):
    """A bare state_dict of two ParMLPs (~200 KB), as torch.save writes it."""
    path = tmp_path / "in.pt"
    torch.save(nn.Sequential(ParMLP(64, 128), ParMLP(64, 128)).state_dict(), path)
    return path


class FillingFile:
    """A file on a disk with ``room`` bytes left: a write past it fails with ENOSPC."""

    def __init__(self, file, room: int) -> None:
        self._file, self._room = file, room

    def write(self, data) -> int:
        self._room -= len(data)
        if self._room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


class FullDisk:
    """``os`` as swiglu_train.files sees it, on a disk that fills up after ``room`` bytes."""

    def __init__(self, room: int) -> None:
        self._room = room

    def fdopen(self, fd, *args, **kwargs):
        return FillingFile(os.fdopen(fd, *args, **kwargs), self._room)

    def __getattr__(self, name):
        return getattr(os, name)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("room", [0, 4096])  # nothing written, or a part of the checkpoint
def test_convert_onto_a_full_disk_is_one_line_naming_the_output(
    entry, tmp_path, checkpoint, room, monkeypatch
):
    """torch.save turned the write's ENOSPC into a RuntimeError ('unexpected pos') traceback."""
    monkeypatch.setattr(swiglu_train.files, "os", FullDisk(room))
    out = tmp_path / "out" / "converted.pt"
    code, err = entry(*CONVERT, str(checkpoint), str(out))
    assert code == 1
    assert one_line(err) == (
        f"error: {out}: No space left on device ({DEBUG_ENV}=1 shows the traceback)\n"
    )
    assert list(out.parent.iterdir()) == []  # no temporary left behind


def test_a_file_size_limit_from_the_system_is_one_line(entry, tmp_path, checkpoint):
    """A real OS failure, not an injected one: the process may write files of 4 KiB at most
    (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    out = tmp_path / "converted.pt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        code, err = entry(*CONVERT, str(checkpoint), str(out))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 1
    assert one_line(err).startswith(f"error: {out}: File too large (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_debug_env_keeps_the_traceback_of_an_os_error(entry, tmp_path, checkpoint, monkeypatch):
    monkeypatch.setattr(swiglu_train.files, "os", FullDisk(4096))  # full in mid-checkpoint
    monkeypatch.setenv(DEBUG_ENV, "1")
    out = tmp_path / "converted.pt"
    with pytest.raises(OSError) as error:
        entry(*CONVERT, str(checkpoint), str(out))
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(out)
    assert isinstance(error.value.__cause__, RuntimeError)  # torch's word for it, kept


@pytest.mark.parametrize("command", ["bench-inference", "bench-memory"])
def test_results_onto_a_full_disk_are_one_line(entry, tmp_path, monkeypatch, command):
    """Each writes its --json through the atomic writer (bench-inference merging a shipped
    result, bench-memory on a CPU-sized stack: no benchmark of note runs)."""
    monkeypatch.setattr(swiglu_train.files, "os", FullDisk(10))
    out = tmp_path / "result.json"
    args = {
        "bench-inference": (
            "--merge",
            str(ROOT / "benchmarks/results/inference/inference_h200.json"),
        ),
        "bench-memory": ("--device", "cpu", "--shape", "8,16,24,16", "--layers", "1"),
    }[command]
    code, err = entry(command, *args, "--json", str(out))
    assert code == 1 and one_line(err).startswith(f"error: {out}: No space left on device (")
    assert list(tmp_path.iterdir()) == []


def test_an_input_that_cannot_be_read_is_one_line_naming_it(entry, tmp_path):
    folder = tmp_path / "a_folder.pt"
    folder.mkdir()
    code, err = entry(*CONVERT, str(folder), str(tmp_path / "out.pt"))
    assert code == 2 and one_line(err).startswith(f"error: {folder}: Is a directory (")


def test_pretrain_names_its_output_dir_for_a_write_error_that_names_no_file(
    entry, tmp_path, monkeypatch
):
    """Lightning writes checkpoints through fsspec, whose ENOSPC names no file."""
    import swiglu_train.integrations.lightning.pretrain as pretrain

    def disk_full(cfg, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pretrain, "run_pretrain", disk_full)
    run = tmp_path / "run"
    code, err = entry("pretrain", "--max-steps", "1", "--output-dir", str(run))
    assert code == 1 and one_line(err).startswith(f"error: {run}: No space left on device (")


def cut(path, keep: int):
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return len(data)


def test_a_truncated_checkpoint_is_reported_damaged_with_sizes(tmp_path, checkpoint):
    """It was 'not a torch checkpoint (neither a torch.save zip nor a pickle)', and past the
    first storage an '[Errno 22] Invalid argument' from torch's seek."""
    out = tmp_path / "out.pt"
    full = cut(checkpoint, 99_000)
    tensors = 2 * (2 * 128 * 64 + 64 * 128) * 4  # fc1 and fc2 of each ParMLP, fp32
    assert full > tensors
    result = CliRunner().invoke(app, [*CONVERT, str(checkpoint), str(out)])
    assert result.exit_code == 2
    message = " ".join(result.output.split())  # the usage box may wrap it
    assert f"{checkpoint} is a damaged checkpoint, cut short" in message
    assert "stops after 99,000 bytes without one" in message
    assert f"its tensors alone take {tensors:,} bytes" in message
    assert not out.exists()


def test_a_checkpoint_missing_only_its_end_is_damaged(tmp_path, checkpoint):
    full = cut(checkpoint, checkpoint.stat().st_size - 20)
    result = CliRunner().invoke(app, [*CONVERT, str(checkpoint), str(tmp_path / "out.pt")])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "is a damaged checkpoint, cut short" in message
    assert f"stops after {full - 20:,} bytes without one" in message


def test_a_truncated_legacy_checkpoint_is_damaged(tmp_path):
    path = tmp_path / "legacy.pt"
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(1000)}, buffer, _use_new_zipfile_serialization=False)
    path.write_bytes(buffer.getvalue()[:600])
    result = CliRunner().invoke(app, [*CONVERT, str(path), str(tmp_path / "out.pt")])
    message = " ".join(result.output.split())
    assert result.exit_code == 2
    assert f"{path} is a damaged checkpoint, cut short: a legacy torch.save pickle" in message
    assert "ends after 600 bytes of at least " in message


def test_an_empty_file_says_so(tmp_path):
    path = tmp_path / "empty.pt"
    path.touch()
    result = CliRunner().invoke(app, [*CONVERT, str(path), str(tmp_path / "out.pt")])
    assert result.exit_code == 2 and "empty.pt is empty (0 bytes)" in result.output


def test_a_checkpoint_corrupted_in_place_is_damaged_not_unsafe(tmp_path, checkpoint):
    """Bytes flipped inside data.pkl read as an unsafe pickle ('pass --trust'), which it is not:
    the zip's CRC of that member says what happened."""
    data = bytearray(checkpoint.read_bytes())
    start = data.find(b"\x80\x02")  # data.pkl's pickle stream, the archive's first member
    data[start + 2 : start + 12] = b"\xff" * 10
    checkpoint.write_bytes(data)
    result = CliRunner().invoke(app, [*CONVERT, str(checkpoint), str(tmp_path / "out.pt")])
    message = " ".join(result.output.split())
    assert result.exit_code == 2
    assert (
        f"{checkpoint} is a damaged checkpoint: its member in/data.pkl fails the zip's CRC"
        in message
    )
    assert "--trust" not in message.replace("--trust]", "")
