"""splitlab.wire."""
