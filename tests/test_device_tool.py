"""scripts/device.py on CPU: its arguments, the stage table it reads, the bounded stage runner and
the xz round trip of the cutlass libs (the GPU box has no network, so a broken carry costs a
device call)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES_FILE = ROOT / "scripts" / "device_stages.sh"


@pytest.fixture
def device():
    spec = importlib.util.spec_from_file_location("device", ROOT / "scripts" / "device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_listed_stage_has_its_function_and_the_file_parses(device):
    text = STAGES_FILE.read_text()
    listed = set(device.stages())
    defined = set(re.findall(r"^stage_(\w+)\(\)", text, re.M))
    assert listed == defined and {"setup", "tests", "grid", "e2e_megatron"} <= listed
    assert device.stages()["scale4"][0] == 4 and device.stages()["megatron_tp2"][0] == 2
    subprocess.run(["bash", "-n", str(STAGES_FILE)], check=True)


def test_the_stages_run_only_files_that_exist():
    text = STAGES_FILE.read_text()
    for path in set(re.findall(r"\b((?:benchmarks|recipes|scripts)/\w+\.(?:py|sh))", text)):
        assert (ROOT / path).is_file(), path


def test_arguments_are_checked_before_any_work(device, capsys):
    assert device.parse(["wheels"]).folders == list(device.WHEELS)
    assert device.parse(["wheels", ".whlx", ".whla"]).folders == [".whlx", ".whla"]
    assert device.parse(["stage", "setup", "grid:300"]).specs == ["setup", "grid:300"]
    for argv, message in (
        (["wheels", ".whlz"], "unknown wheel folders"),
        (["stage", "gird"], "unknown stage 'gird'"),
        (["run", "grid:5m"], "whole seconds"),
        (["stage"], "required"),
    ):
        with pytest.raises(SystemExit) as exit_:
            device.parse(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_wheel_folders_keep_their_names(device):
    """Sessions carry these folders by name (`carry` in the device call)."""
    expected = {
        ".whl",
        ".whlq",
        ".whlqx",
        ".whlx",
        ".whlw",
        ".whlt",
        ".whlm",
        ".whlh",
        ".whla",
        ".whll",
        ".whlmoe",
        ".whls",
    }
    assert set(device.WHEELS) == expected


def test_the_xz_packed_libs_come_back_as_the_wheel_they_were(device, tmp_path):
    unpacked = tmp_path / "x"
    (unpacked / "nvidia_cutlass_dsl" / "lib").mkdir(parents=True)
    (unpacked / "nvidia_cutlass_dsl" / "lib" / "libcute.so").write_bytes(b"\x7fELF" * 100)
    (unpacked / "libs_cu13-4.7.1.dist-info").mkdir()
    (unpacked / "libs_cu13-4.7.1.dist-info" / "RECORD").write_text("")
    carried = tmp_path / ".whlx"
    carried.mkdir()
    with tarfile.open(carried / "cu13libs.tar.xz", "w:xz") as tar:
        tar.add(unpacked, arcname=".")
    (carried / "NAME.txt").write_text("libs_cu13-4.7.1-py3-none-manylinux_2_28_x86_64.whl\n")
    wheel = device.unpack_cutlass_libs(carried, tmp_path / "out")
    assert wheel.name == "libs_cu13-4.7.1-py3-none-manylinux_2_28_x86_64.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert names == {"nvidia_cutlass_dsl/lib/libcute.so", "libs_cu13-4.7.1.dist-info/RECORD"}


def test_the_xz_packed_wheels_come_back_as_the_wheels_they_were(device, tmp_path):
    unpacked = tmp_path / "x" / "quack_kernels-0.6.5-py3-none-any"
    (unpacked / "quack").mkdir(parents=True)
    (unpacked / "quack" / "__init__.py").write_text("version = '0.6.5'\n")
    (unpacked / "quack_kernels-0.6.5.dist-info").mkdir()
    (unpacked / "quack_kernels-0.6.5.dist-info" / "RECORD").write_text("")
    carried = tmp_path / ".whlqx"
    carried.mkdir()
    with tarfile.open(carried / "wheels.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "x", arcname=".")
    (wheel,) = device.unpack_wheels(carried, tmp_path / "out")
    assert wheel.name == "quack_kernels-0.6.5-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert names == {"quack/__init__.py", "quack_kernels-0.6.5.dist-info/RECORD"}
    assert zipfile.ZipFile(wheel).read("quack/__init__.py") == b"version = '0.6.5'\n"


def test_cutlass_dsl_is_packed_as_stage_sonic_extracts_it(device, tmp_path):
    """Its folders at the tarball's top, as a --target site holds them; the .pth stays behind."""
    wheel = tmp_path / "nvidia_cutlass_dsl-4.2.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nvidia_cutlass_dsl/python_packages/cutlass/__init__.py", "")
        z.writestr("nvidia_cutlass_dsl-4.2.1.dist-info/RECORD", "")
        z.writestr("nvidia_cutlass_dsl.pth", "nvidia_cutlass_dsl/python_packages")
    device.pack_cutlass_dsl(wheel, tmp_path)
    with tarfile.open(tmp_path / "cutlass-dsl-4.2.1.tar.xz") as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
    assert files == {
        "nvidia_cutlass_dsl/python_packages/cutlass/__init__.py",
        "nvidia_cutlass_dsl-4.2.1.dist-info/RECORD",
    }


def test_a_git_wheel_holds_only_its_paths_and_is_the_same_built_twice(device, tmp_path):
    """SonicMoE's wheel is built from these paths of its commit: its tests/ must not install as
    a top-level `tests` package beside ours."""
    pytest.importorskip("setuptools.command.bdist_wheel", reason="setuptools < 70.1: no wheels")
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "tests" / "__init__.py").write_text("")
    setup = 'from setuptools import setup, find_packages\nsetup(name="pkg", version="1.0", '
    (repo / "setup.py").write_text(setup + "packages=find_packages())\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "pkg"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    built = []
    for out in (tmp_path / "a", tmp_path / "b"):
        out.mkdir()
        built.append(device.git_wheel(str(repo), commit.strip(), ["setup.py", "pkg"], out))
    assert built[0].name == "pkg-1.0-py3-none-any.whl"
    assert not any(n.startswith("tests/") for n in zipfile.ZipFile(built[0]).namelist())
    assert built[0].read_bytes() == built[1].read_bytes()


def test_a_folder_is_swapped_in_whole_and_never_written_through_a_link(
    device, tmp_path, monkeypatch
):
    """A failed download keeps the old folder; a worktree's link to another checkout's folder
    is replaced by the new one, the other checkout's left as it was."""
    monkeypatch.setattr(device, "ROOT", tmp_path / "root")
    (tmp_path / "root").mkdir()
    (tmp_path / "main" / ".whlt").mkdir(parents=True)
    (tmp_path / "main" / ".whlt" / "old.whl").write_text("old")
    (tmp_path / "root" / ".whlt").symlink_to(tmp_path / "main" / ".whlt")

    def build(name, folder, fail=True):
        folder.mkdir()
        if fail:
            raise RuntimeError("no network")

    monkeypatch.setattr(device, "build", build)
    with pytest.raises(RuntimeError):
        device.build_in_place(".whlt")
    assert (tmp_path / "root" / ".whlt" / "old.whl").exists()
    assert [p.name for p in (tmp_path / "root").iterdir()] == [".whlt"]
    monkeypatch.setattr(device, "build", lambda name, folder: build(name, folder, fail=False))
    folder = device.build_in_place(".whlt")
    assert folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())
    assert [p.name for p in (tmp_path / "main" / ".whlt").iterdir()] == ["old.whl"]


def test_setup_installs_only_what_is_missing(device, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(device, "ROOT", tmp_path)
    monkeypatch.setattr(device.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    (tmp_path / ".whlt").mkdir()
    pytest_version = metadata.version("pytest")
    (tmp_path / ".whlt" / f"pytest-{pytest_version}-py3-none-any.whl").touch()  # installed
    (tmp_path / ".whlt" / "execnet_not_here-9.9-py3-none-any.whl").touch()
    (tmp_path / ".whlq").mkdir()  # .whl's subset: skipped where .whl is carried
    (tmp_path / ".whlq" / "quack_kernels-0.6.5-py3-none-any.whl").touch()
    (tmp_path / ".whls").mkdir()  # stage sonic's, for a site of its own
    (tmp_path / ".whls" / "sonicmoe-0.0.1-py3-none-any.whl").touch()
    device.setup()
    assert len(calls) == 1 and [Path(a).name for a in calls[0] if a.endswith(".whl")] == [
        "quack_kernels-0.6.5-py3-none-any.whl",
        "execnet_not_here-9.9-py3-none-any.whl",
    ]


def test_a_stage_past_its_bound_is_stopped_and_what_finished_comes_back(
    device, tmp_path, monkeypatch
):
    stages = tmp_path / "stages.sh"
    stages.write_text(
        '## write: a result\nstage_write() { echo "$COMMIT" > "$RES/commit.txt"; }\n'
        "## hang: past its bound\nstage_hang() { sleep 60; }\n"
    )
    (tmp_path / "COMMIT").write_text("abc1234\n")
    monkeypatch.setattr(device, "ROOT", tmp_path)
    monkeypatch.setattr(device, "STAGES_FILE", stages)
    monkeypatch.setattr(device, "quack_impls", lambda env: "")
    res = tmp_path / "gpu-results.xyz"
    res.mkdir()
    for name, value in (("OUT", tmp_path / "out"), ("RES", res), ("SCRATCH", tmp_path)):
        monkeypatch.setenv(name, str(value))
    device.run_stages(["write", "hang:1"])
    with tarfile.open(tmp_path / "out" / "results-xyz.tgz") as tar:
        assert tar.extractfile("./commit.txt").read() == b"abc1234\n"


def test_the_tracked_tree_leaves_room_for_quack_s_wheels_in_a_device_call(device):
    """A device call carries the tracked tree and the wheel folders in 64 MiB of 4 KiB blocks:
    grown past what quack's wheels leave, no call could measure the quack impls again."""
    tree = device.tracked_tree_kib()
    room = device.CARRY_LIMIT_KIB - device.QUACK_CARRY_KIB
    assert tree <= room, f"the tracked tree takes {tree} KiB, quack's wheels leave {room}"
    assert device.blocks_kib([1, 4096, 4097]) == 16


def test_carry_adds_the_tracked_tree_and_the_folders_in_blocks_and_says_whether_they_fit(
    device, tmp_path, monkeypatch, capsys
):
    """`device.py carry` plans a call's folders here: a call over the limit is refused."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tracked.py").write_text("x = 1\n")  # one block
    (tmp_path / "untracked.txt").write_text("not sent unless git ignores nothing")
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.py"], check=True)
    (tmp_path / ".whlz" / "sub").mkdir(parents=True)
    (tmp_path / ".whlz" / "a.whl").write_bytes(b"\0" * 5000)  # two blocks
    (tmp_path / ".whlz" / "sub" / "b.whl").write_bytes(b"\0" * 4096)  # one block
    monkeypatch.setattr(device, "ROOT", tmp_path)
    assert device.carry_report([".whlz"]) == (
        ["tracked tree        4 KiB", ".whlz              12 KiB",
         "total              16 KiB of 65536: fits, 65520 KiB left"],
        True,
    )  # fmt: skip
    monkeypatch.setattr(device, "CARRY_LIMIT_KIB", 12)
    with pytest.raises(SystemExit) as over:
        device.main(["carry", ".whlz"])
    assert over.value.code == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("16 KiB of 12: over by 4 KiB")
    with pytest.raises(SystemExit):
        device.main(["carry", ".whlq_absent"])
    assert "no folder .whlq_absent here" in capsys.readouterr().err


def test_stage_moe_runs_ours_then_liger_apart_and_merges_them(device, tmp_path, monkeypatch):
    """The moe stage end to end on CPU, a device call's worth of bash checked before one is
    spent: the pre-warmed main run, Liger's run of its own (it cannot run here, and says
    why), their merge, and each run's whole output in its log."""
    monkeypatch.setattr(device, "quack_impls", lambda env: "")
    res = tmp_path / "gpu-results.xyz"
    res.mkdir()
    env = {
        "OUT": tmp_path / "out", "RES": res, "SCRATCH": tmp_path, "GPU": "cpu",
        "MOE_SHAPES": "32,16,4,2", "MOE_TOKENS": "16", "MOE_DEVICE": "cpu",
        "MOE_ROUTING": "balanced", "MOE_VARIANTS": "normal", "MOE_PREWARM": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # its python3
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    device.run_stages(["moe:300"])
    moe = res / "moe"
    main, liger, merged = (json.loads((moe / f"moe_{n}cpu.json").read_text())
                           for n in ("main_", "liger_", ""))  # fmt: skip
    assert main["meta"]["prewarm"]["points"] == 1 and main["meta"]["variants"] == ["normal"]
    assert [r["variant"] for r in main["rows"]] == ["floor", "normal"]
    assert [s["variant"] for s in liger["skipped"]] == ["liger"]  # no GPU here: its reason
    assert [(r["variant"], r["run"]) for r in merged["rows"]] == [("floor", 0), ("normal", 0)]
    assert [(s["variant"], s["run"]) for s in merged["skipped"]] == [("liger", 1)]
    assert "[pre-warm 1/1]" in (moe / "moe_main_cpu.log").read_text()
    assert "[1/1]" in (moe / "moe_liger_cpu.log").read_text()
