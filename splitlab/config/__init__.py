"""splitlab.config."""
