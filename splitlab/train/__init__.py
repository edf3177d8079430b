"""splitlab.train."""
