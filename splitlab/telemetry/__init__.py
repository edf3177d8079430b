"""Per-process logging setup and JSONL traces (see trace.py, log.py)."""
