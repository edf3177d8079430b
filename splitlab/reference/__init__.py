"""Oracles: the studies' reference engines, every node in one process with direct calls.

Tests and check tools compare the real schedulers and the ring against these; nothing in the
production path imports this package (`tests/unit/test_layering.py` checks).

- `ushape`: `UShapeEngine`, the U-shape window protocol with direct calls.
- `rounds`: `LocalRounds`, federated rounds (train, validate, FedAvg, save, resume) over it.
- `two_stage`: `TwoStageEngine`, both stages of the two-stage mode in one process.
- `generate`: `generate_reference`, the unsplit model decoding greedily with its own cache.
- `tiny`: tiny random-init checkpoints, the ring over one in-process, the oracle's tokens.

    .venv/bin/pytest tests/equivalence/test_train_engine.py tests/equivalence/test_ring_equivalence.py -q
"""
