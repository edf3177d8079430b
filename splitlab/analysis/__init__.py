"""splitlab.analysis: read run traces into pandas frames, fit cost models, derive link
parameters and draw figures. Everything here is pure (frames and arrays in, values and
figures out) except the shells: `traces.load_traces` and `synthetic.write_traces` (files),
`report` (task=analyze), `sweep` (multirun aggregation), `probes` and `calibrate` (timing).

    .venv/bin/pytest tests/unit/test_analysis_traces.py tests/unit/test_analysis_fits.py \
        tests/unit/test_analysis_links.py tests/unit/test_analysis_plots.py -q

- `traces`: `load_traces`, `select`, `transport_by_lane` and the trace-record contract.
- `fits`: `fit_decode`, `fit_prefill`, `fit_link`, `CalibrationResult`, `schema_diff`.
- `links`: `derive_link_params`, `is_loopback` (tool: tools/derive_link_params.py).
- `plots`: figures from frames, and `figure_has_data`.
- `synthetic`: seeded traces with known ground truth, for tests.
- `summary`: key figures and tables of a run (pure).
- `report`: `analyze_run` / `task=analyze`: every applicable PNG and report.html.
- `sweep`: `write_aggregate` over a multirun: sweep.csv and sweep.png (tools/aggregate_sweep.py).
- `probes`, `calibrate`: timing probes and `task=calibrate` (tools/calibrate.py).
"""
