"""splitlab.data."""
