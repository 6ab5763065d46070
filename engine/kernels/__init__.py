"""The compiled kernels: one extension, engine.kernels._kernels (setup.py).

libgomp reads GOMP_SPINCOUNT once, when the extension loads it, so the default is set here first.
Its own default spins a waiting thread ~300k times at every barrier before it sleeps: when another
process holds one of our cores (two workers on two cores, a busy host), the waiting thread burns
the time slice its preempted partner needs, and decode fell from 43 to 7 tok/s (1.5B shape,
measured). 10k spins cost nothing measurable on a quiet machine and keep 46 tok/s under that load
(bench/bench_load.py). A GOMP_SPINCOUNT or OMP_WAIT_POLICY the user set is left alone.
"""
import os

if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
