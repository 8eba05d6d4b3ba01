"""Planner simulation at scale (thin wrapper of ``python -m magi_jax simulate``).

Usage: python bench/simulate.py [--cp 8,16,...] [--seeds 3] [--markdown BENCHMARKS.md]
"""

import sys

from magi_jax.planner.cli import simulate_main

if __name__ == "__main__":
    sys.exit(simulate_main(sys.argv[1:]))
