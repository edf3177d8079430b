"""splitlab's Slurm launcher for Hydra multiruns (`hydra/launcher=slurm`)."""
