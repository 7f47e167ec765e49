"""cafin's bench: `python -m bench` (speed, memory, agreement) and `python -m bench convergence`."""
