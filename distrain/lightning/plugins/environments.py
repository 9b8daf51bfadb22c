"""``lightning.pytorch.plugins.environments``: distrain reads the cluster's variables itself (torchrun, SLURM, MPI,
Kubernetes: ``distrain.cluster``), so a cluster environment is refused where it is imported, saying so."""

from distrain.lightning._refuse import refusing

__getattr__ = refusing(
    __name__,
    "distrain reads torchrun's, SLURM's, MPI's and Kubernetes' variables itself (distrain.cluster), and "
    "`distrain launch slurm` writes a job script that requeues on its signal (docs/multi-node.md)",
)
