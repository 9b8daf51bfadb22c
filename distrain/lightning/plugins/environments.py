"""``lightning.pytorch.plugins.environments``: Lightning's cluster environments, for ``Trainer(plugins=[...])``.

distrain reads torchrun's, SLURM's, MPI's and Kubernetes' variables itself (``distrain.cluster``); an environment
given as a plugin says where a rank is in a way distrain would not find on its own, or how SLURM ends the job:

- ``ClusterEnvironment``: Lightning's interface (the same abstract methods: a subclass without ``detect`` cannot be
  made, as in Lightning). One whose ranks are started outside (``creates_processes_externally``) gives each rank its
  place: its ``world_size()``, ``global_rank()``, ``local_rank()``, ``node_rank()``, ``main_address`` and
  ``main_port`` become the variables the process group reads (``RANK``, ``WORLD_SIZE``...), when the Trainer is made.
- ``SLURMEnvironment(auto_requeue=True, requeue_signal=SIGUSR1)``: the job stops on ``requeue_signal`` at a step,
  every rank alike, with a checkpoint; with ``auto_requeue`` rank 0 then requeues the job (``scontrol requeue``), and
  the requeued job's ``fit`` goes on from that checkpoint. Under SLURM a ``distrain.lightning.Trainer`` without one
  behaves as with ``SLURMEnvironment()``, as Lightning's does.
- ``LightningEnvironment`` and ``TorchElasticEnvironment``: what distrain does without a plugin (it starts the ranks
  itself, or reads torchrun's variables).
"""

from __future__ import annotations

import os
import signal
from abc import ABC, abstractmethod

from distrain.cluster import detect_cluster
from distrain.lightning._refuse import refusing

__all__ = ["ClusterEnvironment", "LightningEnvironment", "SLURMEnvironment", "TorchElasticEnvironment"]


class ClusterEnvironment(ABC):
    """Lightning's specification of a cluster environment (the same abstract members)."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether the environment creates the subprocesses or not."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """The main address through which all processes connect and communicate."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """An open and configured port in the main node through which all processes communicate."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether this process runs in the environment."""

    @abstractmethod
    def world_size(self) -> int:
        """The number of processes across all devices and nodes."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        pass

    @abstractmethod
    def global_rank(self) -> int:
        """The rank of this process across all nodes and devices."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        pass

    @abstractmethod
    def local_rank(self) -> int:
        """The rank of this process inside its node."""

    @abstractmethod
    def node_rank(self) -> int:
        """The rank of the node this process runs on."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:  # noqa: B027 (Lightning's optional hook)
        """Checks the script's settings against the environment (Lightning's hook; nothing by default)."""

    def teardown(self) -> None:  # noqa: B027 (Lightning's optional hook)
        """Cleans up after a run (Lightning's hook; nothing by default)."""


class _Detected(ClusterEnvironment):
    """An environment whose every answer is ``distrain.cluster``'s reading of this process's variables."""

    def __init__(self) -> None:
        self._world_size: int | None = None
        self._global_rank: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return detect_cluster().launched_externally

    @property
    def main_address(self) -> str:
        return detect_cluster().master_addr

    @property
    def main_port(self) -> int:
        return detect_cluster().master_port

    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else detect_cluster().world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank if self._global_rank is not None else detect_cluster().rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    def local_rank(self) -> int:
        return detect_cluster().local_rank

    def node_rank(self) -> int:
        return detect_cluster().node_rank


class LightningEnvironment(_Detected):
    """Lightning's default: the Trainer starts the ranks (distrain's launcher), or finds a launcher's variables."""

    @staticmethod
    def detect() -> bool:
        return True


class TorchElasticEnvironment(_Detected):
    """torchrun's ranks: distrain reads its variables with or without this plugin."""

    @staticmethod
    def detect() -> bool:
        return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


class SLURMEnvironment(_Detected):
    """Ranks started by ``srun``; ``requeue_signal`` (SIGUSR1 unless given: what ``#SBATCH --signal=USR1@90`` sends
    before the time limit) stops the run at a step with a checkpoint, and with ``auto_requeue`` rank 0 requeues the
    job, whose next start resumes from that checkpoint (Lightning's: it saves an HPC checkpoint and requeues)."""

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        super().__init__()
        if not isinstance(auto_requeue, bool):
            raise ValueError(f"SLURMEnvironment(auto_requeue={auto_requeue!r}): must be True or False")
        if requeue_signal is not None and requeue_signal not in set(signal.Signals):
            raise ValueError(f"SLURMEnvironment(requeue_signal={requeue_signal!r}): not a signal (signal.SIGUSR1...)")
        if requeue_signal in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"SLURMEnvironment(requeue_signal={requeue_signal!r}): a process cannot catch it")
        self.auto_requeue = auto_requeue
        self.requeue_signal = signal.Signals(requeue_signal) if requeue_signal is not None else signal.SIGUSR1

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @staticmethod
    def detect() -> bool:
        """Lightning's: ranks started by srun (a job named ``bash`` or ``interactive`` is an allocation's shell)."""
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")

    @staticmethod
    def job_id() -> str | None:
        """The job to requeue: an array task's ``<array job>_<task>``, else ``SLURM_JOB_ID``."""
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        if array is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
            return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        return os.environ.get("SLURM_JOB_ID")

    @staticmethod
    def requeued() -> bool:
        """Whether this start of the job is a requeued one (SLURM counts the restarts)."""
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


#: the environments whose every answer is distrain's own reading of the variables: nothing to place
READ_BY_DISTRAIN = (LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment)

__getattr__ = refusing(
    __name__,
    "distrain reads torchrun's, SLURM's, MPI's and Kubernetes' variables itself (distrain.cluster); Lightning's "
    "ClusterEnvironment, SLURMEnvironment, LightningEnvironment and TorchElasticEnvironment are here",
)
