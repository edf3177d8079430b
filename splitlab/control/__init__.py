"""splitlab.control."""
