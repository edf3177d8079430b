"""splitlab.measure: live measurement on this machine. Timing probes run blocks of a model,
echo frames over the real TCP transport and start co-running processes; calibration turns
their figures into the cost-model JSON (fits from `splitlab.analysis.fits`, which only reads
what is measured here).

- `probes`: decode/prefill of a few blocks, weight load (page cache aware), swap, link echo.
- `calibrate`: `task=calibrate` (tools/calibrate.py): every probe, the fits, the JSON record.

    .venv/bin/python tools/calibrate.py --quick --out /tmp/cal.json
    .venv/bin/pytest tests/integration/test_calibrate.py -q
"""
