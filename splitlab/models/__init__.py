"""Models: families, partition plans, parts cut from unmodified transformers models, loading.

- `plan`: pure `Span` / `PartitionPlan` values (`u_shape_plan`, `two_stage_plan`, `ring_plan`).
- `families`: one `FamilyAdapter` per family (bert, gpt2, llama incl. qwen2) and the registry.
- `parts`: `build_part` / `build_parts` / `build_stages` cut a loaded model into `Part`s that
  share its tensors and keep upstream key names.
- `tokens`: positions, labels and losses from the B x T padding mask.
- `load`: `load_model(cfg)` for random, hub/local and packaged models.

Packaged models' folders come from the asset cache, `splitlab.assets` (below models and data).

    .venv/bin/pytest tests/unit/test_models_plan.py tests/equivalence
"""
