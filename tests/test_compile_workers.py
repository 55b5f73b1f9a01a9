"""torch.compile's worker pool, released: its processes end, and a run that never compiled
has none to release."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from swiglu_train.compile_workers import descendants

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="process tree from /proc")


def _run(code: str) -> list[str]:
    env = os.environ | {"TORCHINDUCTOR_COMPILE_THREADS": "2"}  # a pool, even on 1 core
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_the_pool_s_processes_end_when_released():
    before, released, after = _run(
        """
        from torch._inductor.async_compile import AsyncCompile
        from swiglu_train.compile_workers import descendants, release_compile_workers
        AsyncCompile.wait_pool_ready()  # the sidecar and its 2 workers, as a compile starts
        print(len(descendants()), release_compile_workers(), len(descendants()))
        """
    )
    assert int(before) >= 3  # the sidecar process and its two workers
    assert int(released) == int(before) and after == "0"


def test_a_process_that_never_compiled_has_nothing_to_release():
    assert _run(
        """
        import torch
        from swiglu_train.compile_workers import release_compile_workers
        print(release_compile_workers())
        """
    ) == ["0"]


def test_descendants_follow_the_tree_down():
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"]
    )
    try:
        for _ in range(200):  # until the child has started its sleep
            if descendants(child.pid):
                break
            time.sleep(0.05)
        below = descendants()
        assert child.pid in below and len(descendants(child.pid)) == 1  # the child's sleep
        assert descendants(child.pid) <= below and os.getpid() not in below
    finally:
        child.kill()
        child.wait()
