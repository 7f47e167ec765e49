"""Kept for old links: the experiment now lives in the bench (bench/autoencoder.py).

    python tools/twolevel_experiment.py [--steps N] [--seeds N] [--batch N] [--out PNG] [--json PATH]
is `python -m bench convergence --task autoencoder --steps N --seeds N --batch-size N --plot PNG`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.convergence import main  # noqa: E402

RENAMED = {"--batch": "--batch-size", "--out": "--plot"}

if __name__ == "__main__":
    args = [RENAMED.get(a.split("=", 1)[0], a.split("=", 1)[0]) + ("=" + a.split("=", 1)[1] if "=" in a else "")
            for a in sys.argv[1:]]
    sys.exit(main(["--task", "autoencoder", *args]))
