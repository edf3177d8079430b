"""splitlab: language models split across machines (U-shape fine-tuning, low-rank cuts, rings).

Run `splitlab --help` for the Hydra entry point; see README.md.
"""

__version__ = "0.1.0"
