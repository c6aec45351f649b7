"""`python -m benchmarks`: the same as `python benchmarks/run_all.py`."""

import sys

try:
    from benchmarks.run_all import main
except ImportError:  # run from inside benchmarks/
    from run_all import main

sys.exit(main())
