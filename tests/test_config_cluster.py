"""Typed config layers and launcher-environment detection (no processes needed)."""

import pytest

from distrain.cluster import detect_cluster, expand_slurm_nodelist
from distrain.config import ConfigError, build_config


def test_layers_file_then_flags_then_items(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training: {learning_rate: 0.1, batch_size_per_gpu: 4}\ndistributed: {strategy: ddp}\n")
    c = build_config(cfg, {"distributed.strategy": "single"}, ["training.learning_rate=3e-4", "data.seq_len=64"])
    assert c.training.learning_rate == 3e-4 and c.training.batch_size_per_gpu == 4
    assert c.distributed.strategy == "single" and c.data.seq_len == 64


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("training: {batch_size_per_gpu: 4.5}", "training.batch_size_per_gpu"),
        ("training: {max_grad_norm: abc}", "training.max_grad_norm"),
        ("distributed: {strategy: zero9}", "distributed.strategy"),
        ("distributed: {devices: many}", "distributed.devices"),
        ("training: {precision: fp7}", "training.precision"),
        ("training: {precision: transformer-engine}", "training.precision='transformer-engine' is not run by distrain"),
        ("trainer: {}", "unknown key 'trainer'"),
        ("training: 3", "expected a section"),
        ("[1, 2]", "mapping"),
    ],
)
def test_errors_name_key_and_file(tmp_path, yaml_text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        build_config(cfg)
    assert message in str(e.value)


def test_lightnings_spellings_of_a_precision_read_as_lightning_reads_them():
    with pytest.warns(UserWarning, match="training.precision=16 is Lightning's older spelling of '16-mixed'"):
        assert build_config(None, None, ["training.precision=16"]).training.precision == "16-mixed"
    assert build_config(None, None, ["training.precision=32"]).training.precision == "32-true"
    with pytest.warns(UserWarning, match="training.precision='bf16' is Lightning's older spelling of 'bf16-mixed'"):
        assert build_config(None, None, ["training.precision=bf16"]).training.precision == "bf16-mixed"


def test_null_and_int_widening(tmp_path):
    c = build_config(None, None, ["training.max_grad_norm=null", "training.learning_rate=1", "distributed.devices=3"])
    assert c.training.max_grad_norm is None and c.training.learning_rate == 1.0 and c.distributed.devices == 3


def test_slurm_nodelist_expansion():
    assert expand_slurm_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_slurm_nodelist("node7") == ["node7"]
    assert expand_slurm_nodelist("a[9-11]") == ["a9", "a10", "a11"]


def test_detects_torchrun_slurm_and_plain():
    tr = detect_cluster(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "x",
        }
    )
    assert (tr.source, tr.rank, tr.local_rank, tr.world_size, tr.node_rank) == ("torchrun", 3, 1, 4, 1)
    sl = detect_cluster(
        {
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_NODELIST": "gpu[01-04]",
            "SLURM_JOB_ID": "1234",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_JOB_NAME": "train",
        }
    )
    assert (sl.source, sl.rank, sl.local_rank, sl.world_size, sl.node_rank, sl.master_addr, sl.local_world_size) == (
        "slurm",
        5,
        1,
        8,
        2,
        "gpu01",
        2,
    )
    assert detect_cluster({"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "bash"}).source == "local"
    assert not detect_cluster({}).launched_externally


def test_world_size_mismatch_says_which_numbers(monkeypatch):
    import distrain

    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"1 × 2 = 2.*WORLD_SIZE=4"):
        distrain.Runtime(accelerator="cpu", strategy="ddp", devices=2)


def test_an_elastic_rendezvous_decides_the_number_of_nodes(monkeypatch):
    """torchrun --nnodes 1:4 rendezvoused 2 nodes of 2: a run that names no node count takes the launcher's."""
    import distrain

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for k, v in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    runtime = distrain.Runtime(accelerator="cpu", strategy="ddp")
    assert (runtime.nprocs, runtime.num_nodes, runtime.world_size) == (2, 2, 4)


def test_detects_mpi_and_kubeflow():
    om = detect_cluster(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "MASTER_ADDR": "n0",
        }
    )
    assert (om.source, om.rank, om.local_rank, om.world_size, om.node_rank, om.master_addr, om.master_port) == (
        "mpi",
        5,
        1,
        8,
        1,
        "n0",
        29500,
    )
    pmi = detect_cluster({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (pmi.source, pmi.rank, pmi.world_size, pmi.master_addr) == ("mpi", 1, 2, "127.0.0.1")
    assert detect_cluster({"PMI_RANK": "0", "PMI_SIZE": "1"}).source == "local"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_cluster({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    kf = detect_cluster({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (kf.source, kf.node_rank, kf.num_nodes, kf.launched_externally) == ("kubeflow", 1, 2, False)


def test_kubeflow_node_count_mismatch_names_both(monkeypatch):
    import distrain

    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"num_nodes=2.*WORLD_SIZE=3 pods"):
        distrain.Runtime(accelerator="cpu", strategy="ddp", devices=1, num_nodes=2)
