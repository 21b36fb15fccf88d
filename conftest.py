"""pytest runs the test files in 2 worker processes (pytest.ini: -n 2, pytest-xdist): one torch thread each, so the
two workers do not fight over this 2-core machine's cores (subprocesses inherit OMP_NUM_THREADS=1 too)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
