"""The engine side of the server (no HTTP here): `runtime` composes what a server runs; `engine`
steps the batch; `controller` decides how much to speculate; `model` and `kernels` run the
passes; `model_drafts` drafts with a model; `bench` measures it all.

Importing it sets OpenMP's wait policy to passive unless the environment chose one, before torch
or numba load their OpenMP runtimes (each reads it once, when loaded). By default a worker
thread spins between parallel regions; on a machine where other work holds a core, a spinning
thread takes the time slice its descheduled sibling needs to reach the barrier, and every pass
waits on the scheduler: passes beside one busy core then took tens of times as long, where a
passive wait costs a thread's wake-up per region (docs/benchmarks.md, "OpenMP's wait policy").
"""

import os

if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
