"""splitlab.analysis."""
