"""How long a TCP receive looks for a frame without sleeping (torch-free: config reads it).

A thread woken from sleep pays the kernel's wake-up and runs its next tens of microseconds on
cold caches: a 4 KiB echo between two processes measured ~250 us a round trip with receivers
that sleep at once and ~55-100 us with receivers that look for 100-200 us first (AMD EPYC,
2 cores). A frame that comes within the spin finds its reader awake, so a receive spins only
where the last wait on its lane ended within the spin, and a poll that outlasted it stops
that (`TcpTransport.recv`): replies, barrier messages and streams spin; a stage waiting on a
peer's compute sleeps. The ring (`task=infer`) spins SPIN_US; fine-tuning does not
(`transport.spin_us=0`): its owners and workers poll their lanes while 4 processes compute
on 2 cores, and the default job ran 3-6% slower spinning (19% spinning on every receive).

    .venv/bin/pytest tests/integration/test_wire_tcp.py -q -k spin
"""

from __future__ import annotations

SPIN_US = 200.0  # the ring's (conf/task/infer.yaml) and the benchmarks' default
MAX_SPIN_US = 100_000.0  # a longer spin is a busy wait, not a wake-up saved
