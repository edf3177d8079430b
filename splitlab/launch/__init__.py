"""splitlab.launch."""
