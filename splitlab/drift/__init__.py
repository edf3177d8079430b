"""splitlab.drift."""
