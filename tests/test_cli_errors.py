"""Input errors reach the user as one line, not a traceback; genuine bugs keep theirs."""

import sys

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import CONFIG_DIR

runner = CliRunner()
DEBUG_ENV = "SWIGLU_TRAIN_DEBUG"  # as --help documents it
NO_CUDA = "Invalid value for '--device': CUDA is not available on this machine; pass --device cpu"


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
@pytest.mark.parametrize("command", ["bench", "bench-memory", "bench-crossover", "bench-inference"])
def test_bench_without_cuda_says_so_in_one_line(command):
    result = runner.invoke(app, [command])
    assert result.exit_code == 2, result.output
    assert NO_CUDA in result.output and "Traceback" not in result.output


def test_bench_rejects_a_device_torch_does_not_know():
    result = runner.invoke(app, ["bench", "--device", "gpu0"])
    assert result.exit_code == 2 and "'gpu0' is not a torch device" in result.output


def test_a_usage_error_is_one_line_at_any_width(monkeypatch, tmp_path):
    """Typer's boxed panel wrapped the message at the terminal's width, so whether a test found
    a sentence hung on COLUMNS and on the length of pytest's temporary path."""
    from swiglu_train.cli.app import error_console

    monkeypatch.setattr(error_console, "size", (20, 25))
    table = tmp_path / ("a-long-directory-name-" * 4) / "table.json"
    args = ["bench-inference", "--merge", "run.json", "--judge-table", str(table)]
    result = runner.invoke(app, args, prog_name="swiglu-train")
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: Invalid value for '--judge-table': {table} is not a file "
        "(see swiglu-train bench-inference --help)"
    ]


def test_a_missing_config_is_one_line(entry):
    code, err = entry("pretrain", "--config", "nosuch")
    assert code == 2
    named = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))  # the configs the package ships
    assert err == (
        f"error: config 'nosuch' not found; named configs: {named} "
        f"({DEBUG_ENV}=1 shows the traceback)\n"
    )


def test_an_unknown_impl_is_one_line(entry):
    code, err = entry("bench-memory", "--device", "cpu", "--mlp-impl", "fast[x]")
    assert code == 2 and err.startswith("error: unknown MLP impl 'fast[x]'; valid impls: normal")
    assert err.count("\n") == 1


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_debug_env_shows_the_traceback(entry, monkeypatch, value):
    monkeypatch.setenv(DEBUG_ENV, value)
    with pytest.raises(FileNotFoundError, match="config 'nosuch' not found"):
        entry("pretrain", "--config", "nosuch")


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_debug_env_off_keeps_one_line(entry, monkeypatch, value):
    monkeypatch.setenv(DEBUG_ENV, value)
    code, err = entry("pretrain", "--config", "nosuch")
    assert code == 2 and err.count("\n") == 1


def test_an_error_line_prints_emoji_codes_and_brackets_as_typed(entry):
    """Rich would render ':x:' as an emoji and swallow '[bold]' as a tag."""
    code, err = entry("pretrain", "--config", "7b:x:1[bold]")
    assert code == 2 and "config '7b:x:1[bold]' not found" in err


def test_a_bug_is_not_taken_for_an_input_error(entry, monkeypatch):
    import swiglu_train.integrations.lightning.config as config

    def broken(name):
        raise RuntimeError("a bug")

    monkeypatch.setattr(config, "load_config", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        entry("pretrain", "--config", "tiny")


def invoke(*args: str):
    return runner.invoke(app, list(args))


TINY = ("--device", "cpu", "--dtype", "fp32", "--shape", "8,16,24,16")


@pytest.mark.parametrize(
    "args",
    [
        ("bench-memory", *TINY, "--layers", "0"),
        ("bench-memory", *TINY, "--layers", "2,a"),
        ("bench-memory", *TINY, "--layers", ","),
        ("bench-memory", *TINY, "--mlp-impl", ","),
        ("bench-memory", *TINY, "--overhead-samples", "-1"),
        ("bench-memory", "--device", "cpu", "--shape", "8,16,24,x"),
        ("bench", *TINY, "--variants", "eager", "--stack-layers", "-1", "--samples", "1"),
        ("bench", *TINY, "--variants", ",", "--samples", "1"),
    ],
)
def test_a_number_or_list_out_of_range_names_its_option(args):
    """These ran and printed an empty or meaningless table (layers -1), or said only
    "invalid literal for int()" without naming the option."""
    result = invoke(*args)
    option = next(a for a in args[::-1] if a.startswith("--") and a not in ("--samples",))
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("command", "siblings"), [("bench", ".md"), ("bench-memory", ".png")])
def test_a_json_path_the_table_beside_it_would_replace_is_refused(tmp_path, command, siblings):
    out = tmp_path / f"result{siblings}"
    extra = ("--variants", "eager", "--samples", "1", "--stack-layers", "0")
    result = invoke(command, *TINY, *(extra if command == "bench" else ()), "--json", str(out))
    assert result.exit_code == 2, result.output
    assert "would replace it; give a .json path" in result.output
    assert not out.exists()


def test_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path):
    """A file where a directory goes (or the reverse) failed with an OSError traceback once the
    run, training included, was over."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    ckpt = tmp_path / "in.pt"
    torch.save({"fc1.weight": torch.zeros(8, 4)}, ckpt)
    cases = [
        (("pretrain", "--max-steps", "1", "--output-dir", str(blocker)), "is a file, not a dir"),
        (
            ("pretrain", "--max-steps", "1", "--micro-batch-size", "1", "--output-dir",
             str(tmp_path / "run"), "--summary-json", str(tmp_path)),
            "is a directory; give a file's path",
        ),
        (
            ("convert", "--to", "canonical", "--assume-layout", "canonical", str(ckpt),
             str(blocker / "out.pt")),
            f"{blocker} is a file, so {blocker / 'out.pt'} cannot be written",
        ),
        (
            ("compare-memory", str(tmp_path / "memory.csv"), "--out", str(blocker / "m.png")),
            f"{blocker} is a file, so",
        ),
        (("bench-memory", *TINY, "--layers", "1", "--json", str(blocker / "s.json")), "is a file"),
        (
            ("bench-inference", "--device", "cpu", "--models", "16x24", "--m", "1",
             "--samples", "1", "--plot", str(tmp_path)),
            "is a directory",
        ),
        (
            ("bench-inference", "--device", "cpu", "--models", "16x24", "--m", "1",
             "--samples", "1", "--judge-table", str(tmp_path / "nosuch.json")),
            "nosuch.json is not a file",  # was read only after the benchmark
        ),
    ]  # fmt: skip
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert message in result.output, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "in.pt"]


@pytest.mark.parametrize("devices", ["0", "abc", "-3"])
def test_devices_lightning_refuses_are_one_line(entry, tmp_path, devices):
    """They failed inside the Trainer: a MisconfigurationException or TypeError traceback."""
    code, err = entry("pretrain", "--devices", devices, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and err.startswith("error: train.devices must be auto or a count of at least")
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_devices_in_a_config_are_checked_too(entry, tmp_path):
    (tmp_path / "c.yaml").write_text(f"train: {{devices: 0}}\noutput_dir: {tmp_path / 'run'}\n")
    code, err = entry("pretrain", "--config", str(tmp_path / "c.yaml"))
    assert code == 2 and "train.devices must be auto or a count of at least 1" in err


class Opaque:
    """A pickled object weights_only refuses."""


def test_a_file_that_is_not_a_checkpoint_is_named_without_torch_s_paragraphs(tmp_path):
    """torch's weights_only refusal is a dozen lines with ANSI codes, and for a text file its
    '--trust' hint was wrong: no pickle was refused."""
    (tmp_path / "notes.txt").write_text("hello\n" * 10)
    args = ["convert", "--to", "canonical", "--assume-layout", "canonical"]
    result = invoke(*args, str(tmp_path / "notes.txt"), str(tmp_path / "out.pt"))
    assert result.exit_code == 2 and "notes.txt is not a torch checkpoint" in result.output
    assert "--trust" not in result.output.replace("--trust]", "")

    torch.save({"x": Opaque()}, tmp_path / "obj.pt")
    result = invoke(*args, str(tmp_path / "obj.pt"), str(tmp_path / "out.pt"))
    assert result.exit_code == 2
    assert "cannot load" in result.output and "Unsupported global: GLOBAL" in result.output
    assert "pass --trust if you trust the file" in result.output
    assert "\x1b[" not in result.output and "Please" not in result.output
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("pretrain", "--micro-batch-size", "-4"),  # click's own usage error
        ("pretrain", "--max-steps", "0"),  # an option's range
        ("pretrain", "--devices", "-3"),  # our config check (ValueError)
        ("pretrain", "--config", "nosuch"),  # a file named that is missing (FileNotFoundError)
        ("bench-memory", "--device", "cpu", "--mlp-impl", "fast"),  # the impl registry
        ("convert", "--to", "sideways", "in.pt", "out.pt"),  # the command's own check
    ],
)
def test_every_input_error_exits_2_as_a_usage_error_does(entry, tmp_path, args):
    """A value the config check refused exited 1, the same value refused by click 2."""
    code, err = entry(
        *args, *(("--output-dir", str(tmp_path / "run")) if "pretrain" in args else ())
    )
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--micro-batch-size", "-4", "must be a positive integer or auto, got '-4'"),
        ("--micro-batch-size", "0", "must be a positive integer or auto, got '0'"),
        ("--max-steps", "-1", "greater than or equal to 1"),
        ("--global-batch-size", "-2", "greater than or equal to 1"),
        ("--checkpoint-layers", "-1", "greater than or equal to 0"),
        ("--mlp-chunk", "-3", "greater than or equal to 1"),
        ("--memory-budget-gb", "-1", "must be positive GiB, got -1.0"),
    ],
)
def test_a_negative_number_is_named_as_out_of_range(entry, tmp_path, option, value, says):
    """``--micro-batch-size -4`` said "must be a whole number", which -4 is."""
    extra = ("--activation-checkpointing", "auto") if option == "--memory-budget-gb" else ()
    code, err = entry("pretrain", option, value, *extra, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and says in err and "whole number" not in err, err
    assert not (tmp_path / "run").exists()
