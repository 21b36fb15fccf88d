"""pytest runs the test files in 2 worker processes (pytest.ini: -n 2, pytest-xdist): one torch
thread each, so the two workers do not fight over this 2-core machine's cores (subprocesses
inherit OMP_NUM_THREADS=1 too). Each process gets one empty HF_HOME (no user cache is read or
written), removed when its session ends."""
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
_HF_HOME = None
if "HF_HOME" not in os.environ:
    _HF_HOME = tempfile.mkdtemp(prefix="gmts-hf-")
    os.environ["HF_HOME"] = _HF_HOME

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_sessionfinish(session, exitstatus):
    if _HF_HOME:
        shutil.rmtree(_HF_HOME, ignore_errors=True)
