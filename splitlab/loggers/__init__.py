"""The `logger` config group: where a run's metrics and resolved config go once it ends.

`logger=[csv,tensorboard,mlflow]` selects any of them. Each receives the owners' round metrics
(per owner and sample-weighted over owners, step = round 1..N), the merged model's final
metrics, the ring's TTFT/TPOT/tokens-per-second (task=infer; per-token TPOT, step = token) and
the resolved config. The run's own records (config.yaml, traces/, final_metrics.json,
ring_result.json) are written whatever is selected: the report and the sweep read them.

- `registry`: the options, what each needs installed, `check_loggers` (before spawning).
- `points`: pure: a run's records -> metric points and flat config params.
- `write`: `log_run`, and one writer per option (libraries imported only when selected).

    splitlab logger=[csv,tensorboard,mlflow]
    .venv/bin/pytest tests/unit/test_loggers.py tests/integration/test_loggers_run.py -q
"""
