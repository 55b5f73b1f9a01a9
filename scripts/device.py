#!/usr/bin/env python3
"""The GPU box workflow in one tool. The box has no network: wheels are downloaded here into
git-ignored folders that the device call carries (64 MiB a call), and installed there.

Here, with network:
    python3 scripts/device.py wheels [FOLDER...]   download the wheel folders (all by default)
    python3 scripts/device.py snapshot             freeze HEAD into .src/ (carry it for `run`)
    python3 scripts/device.py carry [FOLDER...]    whether the tree and these folders fit a call
On the GPU box, from the repository root:
    python3 scripts/device.py setup                install whichever wheel folders were carried
    python3 scripts/device.py stage STAGE[:S]...   run stages in this tree; results in $OUT
    python3 scripts/device.py run STAGE[:S]...     setup and the stages on .src's commit, in a
                                                   fresh folder, while the working tree changes
    python3 scripts/device.py list                 the stages (scripts/device_stages.sh)

Each stage is bounded by S seconds (else $STAGE_SECONDS, else unbounded), so that one overrun
cannot cost the others, and $OUT/results-*.tgz is re-packed after each: a call killed at its
limit still returns what finished. Results go to a fresh $RES per call (a lent machine may
keep /tmp from an earlier session, whose results would ride along looking current).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES_FILE = ROOT / "scripts" / "device_stages.sh"

CUTLASS = "4.7.1"
PEERS = [
    "quack-kernels==0.6.5", f"nvidia-cutlass-dsl=={CUTLASS}",
    f"nvidia-cutlass-dsl-libs-base=={CUTLASS}", f"nvidia-cutlass-dsl-libs-core=={CUTLASS}",
    "apache-tvm-ffi==0.1.15.post2",
]  # fmt: skip
WANDB = [
    "wandb==0.31.0", "cwevals==0.0.1b1", "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2", "opentelemetry-proto==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2", "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-exporter-otlp-common==0.66b2", "googleapis-common-protos", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "annotated-types", "typing-inspection", "platformdirs",
    "importlib-metadata", "lazy-importer", "distro", "sniffio", "typing-extensions",
]  # fmt: skip
# SonicMoE is not on the package registry and pins quack at a commit (its requirements.txt):
# both are built from their git snapshots, each from these paths (all where none; sonic-moe's
# tests/ would install as a top-level `tests` package).
SONIC_SOURCES = [
    ("Dao-AILab/sonic-moe", "8565e849c08082e12dbeb7a9de035108a60fe1b2",
     ["setup.py", "LICENSE", "sonicmoe"]),
    ("Dao-AILab/quack", "3d0ab3ec2164749caac8f269f771e66a40efd2de", []),
]  # fmt: skip
# Bare mirrors of GitHub repositories (owner+name/repo), where a machine has no GitHub access
MIRRORS = Path("/work/.mirror")
# Folder: (what it carries, its packages). .whlq + .whlx fit one call beside the tracked tree;
# .whl + .whlx no longer do, and .whlw goes in another call.
WHEELS: dict[str, tuple[str, list[str]]] = {
    ".whl": ("peers: Liger, FLA, quack and its CuTe-DSL deps (11 MB)",
             ["liger-kernel==0.8.5", "fla-core==0.6.0", *PEERS, "torch-c-dlpack-ext==0.1.5"]),
    ".whlq": ("quack and its deps alone, to carry beside .whlx (7 MB)", PEERS),
    ".whlqx": ("quack and its deps unpacked and re-packed with xz (4.8 MB): .whlq's content, for "
               "the call that carries .whlx, where the tree has outgrown .whlq", PEERS),
    ".whlx": ("nvidia-cutlass-dsl-libs-cu13 (88 MB) unpacked and re-packed with xz (48 MB)",
              [f"nvidia-cutlass-dsl-libs-cu13=={CUTLASS}"]),
    ".whlw": ("wandb and the deps the box lacks, megatron-core, py-spy (30 MB)",
              [*WANDB, "megatron-core==0.16.1", "py-spy==0.4.3"]),
    ".whlt": ("pytest-xdist, so the GPU tests compile in parallel (0.1 MB)",
              ["pytest-xdist==3.8.0", "execnet==2.1.2"]),
    ".whlm": ("megatron-core alone, for the Megatron adapter on quack (2.6 MB)",
              ["megatron-core==0.16.1"]),
    ".whlh": ("LitGPT and jsonargparse, for the patch stage (0.4 MB)",
              ["litgpt==0.5.13", "jsonargparse==4.41.0"]),
    ".whla": ("torchao for FP8 training, pure Python (0.8 MB): float8 and what it and transformers "
              "import, without the CUDA extensions and prototypes (3.4 MB whole). Even so it "
              "does not fit beside .whlqx, .whlx and the tree: the device counts 4 KiB blocks, "
              "64.8 MiB there", ["torchao==0.18.0"]),
    ".whll": ("Liger alone (0.9 MB), to carry beside .whlqx and .whlx where the tree leaves room "
              "(`device.py carry .whlqx .whlx .whll` says; 64 MiB in 4 KiB blocks in all)",
              ["liger-kernel==0.8.5"]),
    ".whlmoe": ("torchtitan and the deps the box lacks, for bench-moe's torchtitan columns "
                "(1.6 MB): fits beside .whlqx and .whlx where the tree leaves room (`device.py "
                "carry` says); Liger's columns need .whll too",
                ["torchtitan==0.3.0", "tyro==1.0.17", "docstring-parser==0.18.0",
                 "typeguard==4.6.1", "spmd-types==0.2.3"]),
    ".whls": ("SonicMoE and the quack it pins, built from their commits "
              f"({', '.join(commit[:7] for _, commit, _ in SONIC_SOURCES)}), cuda-python, and "
              "nvidia-cutlass-dsl 4.2.1 re-packed with xz (46 MB): stage sonic's own site, carried "
              "alone (it does not fit beside quack's wheels)",
              ["nvidia-cutlass-dsl==4.2.1", "cuda-python==12.9.10", "cuda-bindings==12.9.10"]),
}  # fmt: skip
# What a device call may carry, in the 4 KiB blocks the device counts, and what quack's wheels
# (.whlqx + .whlx, as `wheels` packs them) take of it: the tracked tree must fit the rest, or
# no call can run the quack impls (tests/test_device_tool.py checks it).
CARRY_LIMIT_KIB = 64 * 1024
QUACK_CARRY_KIB = 53252


def blocks_kib(sizes: list[int]) -> int:
    """KiB of 4 KiB blocks that files of these byte sizes occupy."""
    return sum(-(-size // 4096) * 4 for size in sizes)


def tracked_tree_kib() -> int:
    """What the tracked tree takes of a call's carry: every call sends it beside the folders."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split("\0")  # fmt: skip
    files = [ROOT / p for p in listed if p and (ROOT / p).is_file() and not (ROOT / p).is_symlink()]
    return blocks_kib([f.stat().st_size for f in files])


def carry_report(folders: list[str]) -> tuple[list[str], bool]:
    """One line per part and a total, and whether they fit: a call over the limit is refused
    ("the working tree is larger than 64 MiB"), so plan the folders of a call here first."""
    parts = [("tracked tree", tracked_tree_kib())]
    for folder in folders:
        files = [f for f in (ROOT / folder).rglob("*") if f.is_file() and not f.is_symlink()]
        parts.append((folder, blocks_kib([f.stat().st_size for f in files])))
    total = sum(kib for _, kib in parts)
    left = CARRY_LIMIT_KIB - total
    verdict = f"fits, {left} KiB left" if left >= 0 else f"over by {-left} KiB"
    lines = [f"{name:14} {kib:>6} KiB" for name, kib in parts]
    return [*lines, f"{'total':14} {total:>6} KiB of {CARRY_LIMIT_KIB}: {verdict}"], left >= 0


# py-spy's only wheel is manylinux1: a narrower list skips it
PLATFORMS = [
    "manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "any",
]  # fmt: skip
PIP_INSTALL = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]


def pip_download(folder: Path, packages: list[str]) -> None:
    """Wheels for the box (CPython 3.12, x86_64), whatever this machine runs."""
    folder.mkdir(exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
         *packages],
        check=True,
    )  # fmt: skip


# xz's x86 branch filter shrinks shared libraries; the dictionary holds the largest of them
LIBS_XZ = "--x86 --lzma2=preset=9e,dict=192MiB"
# Sorted, owned by root and dated 2000-01-01 (zip, as `setup` re-zips them, starts at 1980):
# the same wheels give the same tarball.
TAR_FIXED = ["--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--mtime=@946684800"]


def tar_xz(tarball: Path, tree: Path, members: list[str], xz_opt: str) -> None:
    """tree's members (paths relative to it) into one xz tarball."""
    tar = ["tar", "cJf", str(tarball), *TAR_FIXED, "-C", str(tree), *members]
    subprocess.run(tar, env=dict(os.environ, XZ_OPT=xz_opt), check=True)


def pack_cutlass_libs(folder: Path) -> None:
    """.whlx: the cu13 libs wheel unpacked and re-compressed with xz, whose x86 branch filter
    shrinks its shared libraries (88 -> 48 MB), so that it fits one carry with quack's wheels."""
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), WHEELS[".whlx"][1])
        wheel = next(Path(tmp).glob("*.whl"))
        unpacked = Path(tmp) / "x"
        zipfile.ZipFile(wheel).extractall(unpacked)
        folder.mkdir(exist_ok=True)
        tar_xz(folder / "cu13libs.tar.xz", unpacked, ["."], LIBS_XZ)
        (folder / "NAME.txt").write_text(wheel.name + "\n")


def pack_wheels(folder: Path, packages: list[str]) -> None:
    """.whlqx: each wheel unpacked into a folder of its own name, all in one xz tarball (the
    zip compression of a wheel leaves xz little to find; its contents compress to 60 %)."""
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), packages)
        unpacked = Path(tmp) / "x"
        for wheel in Path(tmp).glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(unpacked / wheel.stem)
        folder.mkdir(exist_ok=True)
        tar_xz(folder / "wheels.tar.xz", unpacked, ["."], "--x86 --lzma2=preset=9e")


# What torchao's float8 training, its package __init__ and transformers' torchao quantizer import;
# the rest (the compiled .so files, models, C++ sources, other prototypes) stays behind.
TORCHAO_DROPPED = ("_C", "_models", "csrc")
TORCHAO_PROTOTYPES_KEPT = ("quantization", "safetensors", "mx_formats")


def strip_torchao(folder: Path) -> None:
    """.whla: torchao's wheel re-zipped without what FP8 training never imports (RECORD
    trimmed to match), so pip installs it as the same version."""
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), WHEELS[".whla"][1])
        wheel = next(Path(tmp).glob("*.whl"))
        folder.mkdir(exist_ok=True)

        def kept(name: str) -> bool:
            inner = name.removeprefix("torchao/")
            if inner.startswith("prototype/") and inner.count("/") > 1:
                return inner.split("/")[1] in TORCHAO_PROTOTYPES_KEPT
            return not (name.startswith("torchao/") and inner.startswith(TORCHAO_DROPPED))

        with (
            zipfile.ZipFile(wheel) as src,
            zipfile.ZipFile(folder / wheel.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out,
        ):
            names = [n for n in src.namelist() if kept(n)]
            for name in names:
                data = src.read(name)
                if name.endswith(".dist-info/RECORD"):
                    rows = data.decode().splitlines()
                    data = ("\n".join(r for r in rows if r.split(",")[0] in names) + "\n").encode()
                out.writestr(name, data)


def pack_cutlass_dsl(wheel: Path, folder: Path) -> None:
    """cutlass-dsl's wheel as the tarball stage sonic extracts into its --target site (62 ->
    40 MB): its folders, without the .pth such a site never reads (the stage puts
    python_packages on PYTHONPATH itself)."""
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        folders = sorted(p.name for p in Path(tmp).iterdir() if p.is_dir())
        version = wheel.name.split("-")[1]
        tar_xz(folder / f"cutlass-dsl-{version}.tar.xz", Path(tmp), folders, LIBS_XZ)


def git_source(repo: str) -> str:
    """repo's bare mirror on this machine if there is one, else GitHub."""
    mirror = MIRRORS / repo.replace("/", "+") / "repo"
    return str(mirror) if mirror.is_dir() else f"https://github.com/{repo}.git"


def require_wheel_builder() -> None:
    """Refuse in one line, before any download, a Python whose setuptools cannot build a wheel
    offline: bdist_wheel is setuptools' own from 70.1, else the wheel package's."""
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401
    except ImportError:
        if importlib.util.find_spec("wheel") is None:
            sys.exit(
                f"{sys.executable} cannot build wheels offline (setuptools < 70.1 and no wheel "
                "package): run this with a Python that can, e.g. the project's venv"
            )


def git_wheel(source: str, commit: str, paths: list[str], folder: Path) -> Path:
    """The wheel of commit's paths (all where none) in folder, built offline by this
    environment's setuptools and dated at the commit: the same commit gives the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:

        def git(*args: str) -> str:
            run = subprocess.run(["git", "-C", tmp, *args], stdout=subprocess.PIPE, text=True,
                                 check=True)  # fmt: skip
            return run.stdout.strip()

        git("init", "-q")
        git("fetch", "-q", "--depth", "1", source, commit)
        git("archive", "-o", "src.tar", "FETCH_HEAD", *paths)
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        with tarfile.open(Path(tmp) / "src.tar") as tar:
            tar.extractall(src, filter="tar")
        epoch = git("log", "-1", "--format=%ct", "FETCH_HEAD")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", str(out), str(src)],
            env=dict(os.environ, SOURCE_DATE_EPOCH=epoch), check=True,
        )  # fmt: skip
        return Path(shutil.move(next(out.glob("*.whl")), folder))


def build_sonic(folder: Path) -> None:
    """.whls: stage sonic's own site (its quack is not ours): the pinned wheels, cutlass-dsl
    re-packed, SonicMoE and its quack built from their commits, which SOURCE.txt names."""
    require_wheel_builder()
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), WHEELS[".whls"][1])
        folder.mkdir()
        for wheel in Path(tmp).glob("*.whl"):
            if wheel.name.startswith("nvidia_cutlass_dsl-"):
                pack_cutlass_dsl(wheel, folder)
            else:
                shutil.move(wheel, folder)
    built = [(repo, commit, git_wheel(git_source(repo), commit, paths, folder))
             for repo, commit, paths in SONIC_SOURCES]  # fmt: skip
    (folder / "SOURCE.txt").write_text("".join(f"{r} {c} {w.name}\n" for r, c, w in built))


def unpack_wheels(folder: Path, into: Path) -> list[Path]:
    """.whlqx back into the wheels it was."""
    unpacked = into / "wheels"
    with tarfile.open(folder / "wheels.tar.xz") as tar:
        tar.extractall(unpacked, filter="tar")
    wheels = []
    for tree in sorted(p for p in unpacked.iterdir() if p.is_dir()):
        wheels.append(into / f"{tree.name}.whl")
        with zipfile.ZipFile(wheels[-1], "w", zipfile.ZIP_STORED) as z:
            for path in sorted(tree.rglob("*")):
                if path.is_file():
                    z.write(path, path.relative_to(tree))
    return wheels


def ignore_locally(*folders: str) -> None:
    """This clone's info/exclude: carried folders are never committed nor in `git status`, yet
    the device tool carries them when a call names them."""
    git = ["git", "rev-parse", "--git-path", "info/exclude"]
    found = subprocess.run(git, cwd=ROOT, capture_output=True, text=True)
    if found.returncode:  # not a clone: nothing to keep out of `git status`
        return
    exclude = ROOT / found.stdout.strip()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    lines += [f"/{f}/" for f in folders if f"/{f}/" not in lines]
    exclude.write_text("\n".join(lines) + "\n")


def build(name: str, folder: Path) -> None:
    """One wheel folder, from nothing."""
    if name == ".whlx":
        pack_cutlass_libs(folder)
    elif name == ".whlqx":
        pack_wheels(folder, WHEELS[name][1])
    elif name == ".whla":
        strip_torchao(folder)
    elif name == ".whls":
        build_sonic(folder)
    else:
        pip_download(folder, WHEELS[name][1])


def build_in_place(name: str) -> Path:
    """Built beside its place and renamed into it: a failed download leaves the old folder whole,
    and no half-built one is carried. A link there (a worktree sharing another checkout's
    folders) is replaced, never written through."""
    folder = ROOT / name
    with tempfile.TemporaryDirectory(dir=ROOT, prefix=f"{name}.") as tmp:
        build(name, Path(tmp) / name)
        if folder.is_symlink():
            folder.unlink()
        shutil.rmtree(folder, ignore_errors=True)
        (Path(tmp) / name).rename(folder)
    return folder


def wheels(folders: list[str]) -> None:
    ignore_locally(*folders)
    for name in folders:
        folder = build_in_place(name)
        size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
        print(f"{name}  {size:5.1f} MiB  {WHEELS[name][0]}")


def installed(wheel: Path) -> bool:
    dist, version = wheel.name.split("-")[:2]
    try:
        return metadata.version(dist.replace("_", "-")) == version
    except metadata.PackageNotFoundError:
        return False


def unpack_cutlass_libs(folder: Path, into: Path) -> Path:
    """.whlx back into the wheel it was (pip installs wheels, not tarballs)."""
    name = (folder / "NAME.txt").read_text().strip()
    unpacked = into / "cu13x"
    with tarfile.open(folder / "cu13libs.tar.xz") as tar:
        tar.extractall(unpacked, filter="tar")
    wheel = into / name
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path in sorted(unpacked.rglob("*")):
            if path.is_file():
                z.write(path, path.relative_to(unpacked))
    return wheel


def setup() -> None:
    """Install each carried folder's wheels that are not installed yet (a warm machine keeps
    them), with `python3 -m pip` into python3's own environment: quack needs a real
    site-packages path (it fingerprints code outside it), cutlass-dsl its .pth file processed.
    .whls is stage sonic's, for a site of its own: its quack would replace ours."""
    packed = (".whlx", ".whlqx", ".whls")
    carried = [ROOT / n for n in WHEELS if n not in packed and (ROOT / n).is_dir()]
    if (ROOT / ".whl").is_dir():  # .whlq is .whl's subset
        carried = [f for f in carried if f.name != ".whlq"]
    with tempfile.TemporaryDirectory() as tmp:
        todo = [w for f in carried for w in sorted(f.glob("*.whl")) if not installed(w)]
        if (ROOT / ".whlqx").is_dir():
            todo += [w for w in unpack_wheels(ROOT / ".whlqx", Path(tmp)) if not installed(w)]
        cutlass = ROOT / ".whlx"
        if cutlass.is_dir() and not installed(Path((cutlass / "NAME.txt").read_text().strip())):
            todo.append(unpack_cutlass_libs(ROOT / ".whlx", Path(tmp)))
        by_name = {w.name.split("-")[0]: w for w in todo}  # a wheel carried twice, once
        if by_name:
            subprocess.run([sys.executable, *PIP_INSTALL, *map(str, by_name.values())], check=True)
    print(f"installed {len(by_name)} wheels from {[f.name for f in carried]}")


def snapshot() -> None:
    """.src/head.tgz: HEAD's tree the tests and benchmarks read; .src/COMMIT its short hash. The
    box then runs exactly this commit, and results name it although the box has no git."""
    src = ROOT / ".src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    paths = ["swiglu_train", "benchmarks", "scripts", "tests", "recipes", "pyproject.toml",
             "README.md", ".ci", "docs"]  # fmt: skip
    archive = subprocess.run(["git", "archive", "--format=tar.gz", "HEAD", *paths], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    (src / "head.tgz").write_bytes(archive)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True, check=True).stdout.strip()  # fmt: skip
    (src / "COMMIT").write_text(commit + "\n")
    ignore_locally(".src")
    print(f"snapshot of {commit}: {len(archive) / 2**20:.1f} MiB")


def stages() -> dict[str, tuple[int, str]]:
    """NAME -> (GPUs, help line), from the stages file's `## NAME (N GPUs): help` lines."""
    found = re.findall(r"^## (\w+)(?: \((\d) GPUs\))?: (.*)$", STAGES_FILE.read_text(), re.M)
    return {name: (int(gpus or 1), help_line) for name, gpus, help_line in found}


def quack_impls(env: dict[str, str]) -> str:
    """The quack impls where quack runs here; asked per stage, as `setup` may install it."""
    code = (
        "from swiglu_train.layers.registry import QUACK_IMPLS\n"
        "from swiglu_train.ops.quack_mlp import quack_available\n"
        "print(*sorted(QUACK_IMPLS) if quack_available() else [])"
    )
    found = subprocess.run(["python3", "-c", code], env=env, capture_output=True, text=True)
    return found.stdout.strip()


def run_stages(specs: list[str]) -> None:
    """Each stage in its own process group, killed whole at its bound."""
    out = Path(os.environ.get("OUT", "./gpu-out")).resolve()
    res = Path(os.environ.get("RES") or tempfile.mkdtemp(prefix="gpu-results."))
    scratch = Path(os.environ.get("SCRATCH") or tempfile.mkdtemp(prefix="gpu-scratch."))
    # results name the snapshot's commit (.src/COMMIT, copied in by `run`), not the box's HEAD
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    commit = (ROOT / "COMMIT").read_text().strip() if (ROOT / "COMMIT").exists() else git
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline",
               WANDB_SILENT="true", OUT=str(out), RES=str(res), SCRATCH=str(scratch),
               COMMIT=commit or "unknown", SWIGLU_TRAIN_COMMIT=commit or "unknown")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    default = float(os.environ.get("STAGE_SECONDS") or "inf")
    for spec in specs:
        name, _, seconds = spec.partition(":")
        print(f"== {name}", flush=True)
        script = f"set -uo pipefail; source {STAGES_FILE}; stage_{name}"
        env["QUACK"] = quack_impls(env)
        proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=float(seconds) if seconds else default)
            if code:
                print(f"== {name}: exit {code}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"== {name}: stopped at its bound")
        pack(res, out, commit)


def pack(res: Path, out: Path, commit: str) -> None:
    """$RES into $OUT/results-SUFFIX.tgz (one archive per results folder: two invocations in
    one device call must not overwrite each other's), with the e2e points kept across calls."""
    kept = sorted(Path(f"/tmp/gpu-e2e-{commit}").glob("e2e_*.json"))
    if kept:  # an e2e stage cut at its bound has its points only there
        (res / "e2e").mkdir(exist_ok=True)
        for path in kept:
            shutil.copy(path, res / "e2e")
    with tarfile.open(out / f"results-{res.name.split('.')[-1]}.tgz", "w:gz") as tar:
        tar.add(res, arcname=".")


def run(specs: list[str]) -> None:
    """.src's commit in a fresh folder (a warm machine keeps /tmp, and copying wheel folders
    into ones left there nests them), the carried wheel folders beside it, setup, the stages."""
    carried = ROOT
    src = Path(tempfile.mkdtemp(prefix="src."))
    with tarfile.open(carried / ".src" / "head.tgz") as tar:
        tar.extractall(src, filter="tar")
    shutil.copy(carried / ".src" / "COMMIT", src / "COMMIT")
    for name in WHEELS:
        if (carried / name).is_dir():
            shutil.copytree(carried / name, src / name)
    os.environ.setdefault("OUT", str(carried / "gpu-out"))
    os.environ.setdefault("STAGE_SECONDS", "590")
    subprocess.run([sys.executable, "scripts/device.py", "stage", "setup", *specs], cwd=src,
                   env=dict(os.environ, PYTHONPATH=str(src)), check=True)  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="download the wheel folders here")
    w.add_argument("folders", nargs="*", metavar="FOLDER", help=f"any of {', '.join(WHEELS)}")
    sub.add_parser("snapshot", help="freeze HEAD into .src/")
    c = sub.add_parser("carry", help="whether the tree and these folders fit one call's carry")
    c.add_argument("folders", nargs="*", metavar="FOLDER", help="wheel folders, as run's carry")
    sub.add_parser("setup", help="install the carried wheel folders (on the box)")
    sub.add_parser("list", help="the stages, one line each")
    for name in ("stage", "run"):
        s = sub.add_parser(name, help="run stages (on the box)")
        s.add_argument("specs", nargs="+", metavar="STAGE[:SECONDS]")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        args.folders = args.folders or list(WHEELS)
        if unknown := sorted(set(args.folders) - set(WHEELS)):
            parser.error(f"unknown wheel folders {unknown}; they are {', '.join(WHEELS)}")
    if args.command == "carry" and (absent := [f for f in args.folders if not (ROOT / f).is_dir()]):
        parser.error(f"no folder {', '.join(absent)} here; `device.py wheels FOLDER` builds it")
    for spec in getattr(args, "specs", []):
        name, _, seconds = spec.partition(":")
        if name not in stages():
            parser.error(f"unknown stage {name!r}; `python3 scripts/device.py list` lists them")
        if seconds and not seconds.isdigit():
            parser.error(f"{spec!r}: the bound is whole seconds, as in {name}:300")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.command == "wheels":
        wheels(args.folders)
    elif args.command == "snapshot":
        snapshot()
    elif args.command == "carry":
        lines, fits = carry_report(args.folders)
        print("\n".join(lines))
        sys.exit(0 if fits else 1)
    elif args.command == "setup":
        setup()
    elif args.command == "list":
        for name, (gpus, help_line) in stages().items():
            print(f"{name:17} {'' if gpus == 1 else f'({gpus} GPUs) '}{help_line}")
    elif args.command == "stage":
        run_stages(args.specs)
    else:
        run(args.specs)


if __name__ == "__main__":
    main()
