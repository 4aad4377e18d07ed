"""Python imports this module at startup in a process whose PYTHONPATH names this folder: the resume
tests give it to their target replicas (``cluster.runtime_env``), which then run with the fault
injection of ``tests/cluster/faults.py`` installed."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.cluster.faults import install  # noqa: E402

install()
