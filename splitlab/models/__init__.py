"""splitlab.models."""
