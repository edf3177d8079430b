"""splitlab.analysis: read run traces into pandas frames, fit cost models, derive link
parameters and draw figures. Everything here is pure (frames and arrays in, values and
figures out) except the shells, which read and write files only: `traces.load_traces` and
`synthetic.write_traces`, `report` (task=analyze), `sweep` (multirun aggregation), `rounds`
(a fine-tuning run's metrics.csv and plot). Live measurement (timing probes, calibration runs)
is `splitlab.measure`.

    .venv/bin/pytest tests/unit/test_analysis_traces.py tests/unit/test_analysis_fits.py \
        tests/unit/test_analysis_links.py tests/unit/test_analysis_plots.py -q

- `traces`: `load_traces`, `select`, `transport_by_lane` and the trace-record contract.
- `fits`: `fit_decode`, `fit_prefill`, `fit_link`, `CalibrationResult`, `schema_diff`.
- `links`: `derive_link_params` (tool: tools/derive_link_params.py).
- `plots`: figures from frames, and `figure_has_data`.
- `synthetic`: seeded traces with known ground truth, for tests.
- `summary`: key figures and tables of a run (pure).
- `result`: what a report leads with: merged-model test metrics, wall time, bytes, placement.
- `formatting`: numbers for people (counts, KiB/MiB/GiB, ms) for every page, table and axis.
- `pages`: the HTML blocks both reports share.
- `report`: `analyze_run` / `task=analyze`: every applicable PNG and report.html.
- `sweep`: `write_aggregate` over a multirun: sweep.csv, sweep.png and a sweep report.html
  (tools/aggregate_sweep.py).
- `rounds`: a fine-tuning run's round records -> metrics.csv, training_rounds.png, summary.
"""
