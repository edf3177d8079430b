"""Running splitlab under a cluster scheduler (Slurm): what a run asks for, what a job left."""
