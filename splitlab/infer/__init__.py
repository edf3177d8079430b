"""splitlab.infer."""
