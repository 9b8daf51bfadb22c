import os
import sys

# the tests' shared helpers (tests/helpers.py) import as `helpers`, in spawned ranks too
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: ranks must not fight over threads
