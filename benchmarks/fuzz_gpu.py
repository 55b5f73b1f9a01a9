"""Fuzz every ParMLP impl on random shapes against a float64 reference (bench/fuzz/run.py).

    python3 benchmarks/fuzz_gpu.py [--cases 1000] [--seed 0] [--device auto|cuda|cpu] [--workers N]
        [--json OUT.json] [--max-seconds S] [--tune quick|full] [--impls normal,drop_h,...]
    python3 benchmarks/fuzz_gpu.py --repro '<the case JSON a failure printed>' [--device cuda]

Each failure prints a one-line reproduction as it happens; the summary (and --json) counts cases
per status, impl and dtype, auto's picks, and lists every failure with its reproduction. Exits 1
if any case failed. Without CUDA (or with --device cpu) it runs CPU-sized cases in the Triton
interpreter. ``--tune quick`` (the default) times each Triton autotuning candidate in a few runs
instead of Triton's 100 ms, so that the run spends its time on cases, not on timing configs
for hundreds of shapes; which config wins does not change what a kernel must compute.
``--workers N`` runs the cases in N spawned processes, so that their JIT compiles (CPU-bound,
most of a GPU run's time) overlap; the same seed draws the same cases, and the summary lists
them in case order. On the H200 (16 cores):

    python3 benchmarks/fuzz_gpu.py --cases 1000 --workers 8 --max-seconds 420 --json OUT.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import sys
import time

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="how many cases to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda or cpu")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--max-seconds", type=float, help="start no case after this long")
    parser.add_argument("--workers", type=int, default=1, help="processes (1: this one)")
    parser.add_argument("--tune", choices=("quick", "full"), default="quick")
    parser.add_argument("--impls", help="only these impls, comma-separated")
    parser.add_argument("--repro", metavar="CASE_JSON", help="run this one case and report it")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases must be at least 1, got {args.cases}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available here")
    return device


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = pick_device(args.device)
    if device.type == "cpu":  # before any kernel is defined: kernels run in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from swiglu_train.bench.fuzz import cases as fuzz_cases
    from swiglu_train.bench.fuzz import pool as fuzz_pool
    from swiglu_train.bench.fuzz import run as fuzz
    from swiglu_train.bench.results import git_commit
    from swiglu_train.files import write_json_atomic

    def repro(case: fuzz_cases.Case) -> str:
        return f"python3 benchmarks/fuzz_gpu.py --device {device.type} --repro '{case.to_json()}'"

    def report(outcome: fuzz.Outcome) -> None:
        if outcome.status in ("failed", "platform"):
            picked = f" [auto: {outcome.resolved_impl}]" if outcome.case.impl == "auto" else ""
            label = outcome.status.upper()
            print(f"{label}{picked}: {'; '.join(outcome.problems)}\n  {repro(outcome.case)}")

    quick = args.tune == "quick" and device.type == "cuda"
    tuned = fuzz_pool.quick_autotune() if quick else 0  # workers do it again, each for itself
    if args.repro:
        outcome = fuzz.run_case(fuzz_cases.Case.from_json(args.repro), device)
        report(outcome)
        print(f"{outcome.status} ({outcome.resolved_impl}, {outcome.seconds:.2f} s)")
        return 1 if outcome.status == "failed" else 0
    impls, skipped = fuzz_cases.available_impls(device)
    if args.impls:
        wanted = args.impls.split(",")
        unknown = sorted(set(wanted) - set(impls) - set(skipped))
        if unknown:
            raise SystemExit(f"error: unknown impls {unknown}; choose from {impls}")
        impls = [i for i in impls if i in wanted]
    sizes = fuzz_cases.GPU_SIZES if device.type == "cuda" else fuzz_cases.CPU_SIZES
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"{args.cases} cases on {gpu or device.type}, impls {impls}, skipped {skipped}")
    start, done = time.perf_counter(), [0]

    def progress(outcome: fuzz.Outcome) -> None:
        report(outcome)
        done[0] += 1
        if done[0] % 100 == 0:
            print(f"[{done[0]}/{args.cases}] {time.perf_counter() - start:.0f} s")

    points = fuzz_cases.auto_table_points(device) if "auto" in impls else []
    cases = fuzz_cases.draw_cases(args.seed, args.cases, impls, sizes, points)
    if args.workers == 1:
        outcomes, stopped = fuzz.run_cases(cases, device, progress, args.max_seconds)
    else:
        outcomes, stopped = fuzz_pool.run_cases_pool(
            list(cases), device, args.workers, progress, args.max_seconds, tune_quick=quick
        )
    result = {
        "schema": 1,
        "command": shlex.join(["python3", "benchmarks/fuzz_gpu.py", *argv]),
        "commit": git_commit(),
        "device": device.type,
        "gpu": gpu,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": version("triton"), "quack-kernels": version("quack-kernels")},
        "seed": args.seed,
        "cases_requested": args.cases,
        "workers": args.workers,
        "complete": stopped is None,
        "stopped": stopped,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "impls": impls,
        "skipped_impls": skipped,
        "autotune": f"quick ({tuned} autotuners time 2 ms per config)" if tuned else "triton's",
        "tolerance": fuzz.TOLERANCE,
        "sizes": vars(sizes),
        "auto_table_points": points,
        **fuzz.summary(outcomes, repro),
    }  # fmt: skip
    counts = result["counts"]
    print(f"{len(outcomes)} cases in {result['elapsed_s']} s: {counts}; {stopped or 'complete'}")
    print(f"per impl: {result['per_impl']}; auto picked {result['auto_picks']}")
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    return 1 if counts.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
