"""select_device: each rank's GPU under torchrun, under launchers that mask devices per rank
(srun --gpus-per-task), and the --device spellings; CPU twins with a patched torch.cuda, and the
same choices on a real GPU where there is one."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER


def node(local_rank: int, ranks: int = 8, nodes: int = 1) -> DistInfo:
    return DistInfo(rank=local_rank, local_rank=local_rank, world_size=ranks * nodes, local_world_size=ranks)


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine on which this process sees ``n`` CUDA devices (set through the returned function)."""
    chosen: list[torch.device] = []

    def see(n: int, mask: str | None = None) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d: SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30))
        if mask is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
        return chosen

    return see


def test_each_rank_takes_its_local_rank_when_it_sees_the_whole_node(fake_gpus):
    set_devices = fake_gpus(8)
    got = [dist.select_device("", 64, node(r)) for r in range(8)]
    assert got == [torch.device("cuda", r) for r in range(8)] and set_devices == got


@pytest.mark.parametrize("device", ["", "cuda", "0"])
def test_one_gpu_per_rank_from_the_launcher(fake_gpus, device):
    """srun --gpus-per-task=1: every rank sees one device, its own, whatever its local rank."""
    for r in range(8):
        fake_gpus(1, mask=str(r))
        assert dist.select_device(device, 64, node(r, nodes=2)) == torch.device("cuda", 0)


def test_two_gpus_per_rank_from_the_launcher_stay_within_the_rank(fake_gpus):
    for r in range(4):
        fake_gpus(2, mask=f"{2 * r},{2 * r + 1}")
        assert dist.select_device("", 16, node(r, ranks=4)).index == r % 2


def test_more_ranks_than_gpus_without_a_mask_is_refused(fake_gpus):
    """torchrun --nproc_per_node 4 on a 2-GPU node: every rank stops (not only the ranks past the GPUs)."""
    fake_gpus(2)
    for r in range(4):
        with pytest.raises(UserError, match=rf"local rank {r} has no CUDA device \(2 visible for 4 ranks.*"
                                            r"torchrun --nproc_per_node 2.*CUDA_VISIBLE_DEVICES"):
            dist.select_device("", 16, node(r, ranks=4))


def test_a_device_list_is_indexed_by_local_rank(fake_gpus):
    fake_gpus(8)
    assert [dist.select_device("4,5,6,7", 16, node(r, ranks=4)).index for r in range(4)] == [4, 5, 6, 7]
    with pytest.raises(UserError, match="--device 4,5: 2 device\\(s\\) for 4 ranks on this node"):
        dist.select_device("4,5", 16, node(0, ranks=4))


def test_a_device_list_that_counts_physical_gpus_under_a_per_rank_mask_says_so(fake_gpus):
    fake_gpus(1, mask="3")
    with pytest.raises(UserError, match=r"--device 0,1,2,3: no CUDA device 1,2,3: this process sees 1 "
                                        r"\(CUDA_VISIBLE_DEVICES=3\)"):
        dist.select_device("0,1,2,3", 16, node(3, ranks=4))


@pytest.mark.parametrize("device", ["0,0", "1,0,1", "cuda:0,0"])
def test_a_device_listed_twice_is_refused(fake_gpus, device):
    fake_gpus(2)
    for info in (DistInfo(), node(0, ranks=2)):
        with pytest.raises(UserError, match=f"--device {device}: device .* is listed more than once"):
            dist.select_device(device, 16, info)


def test_a_single_process_uses_the_first_listed_device_and_says_so(fake_gpus, caplog):
    fake_gpus(2)
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert dist.select_device("1,0", 16, DistInfo()) == torch.device("cuda", 1)
    assert "one process uses one device, cuda:1" in caplog.text
    assert "torchrun --nproc_per_node 2" in caplog.text


@pytest.mark.parametrize("device, index", [("cuda", 0), ("cuda:1", 1), ("CUDA:1", 1), ("1", 1), ("", 0)])
def test_cuda_spellings(fake_gpus, device, index):
    fake_gpus(2)
    assert dist.select_device(device, 16, DistInfo()) == torch.device("cuda", index)


@pytest.mark.parametrize("device", ["gpu", "0,x", "cuda:", ","])
def test_unknown_spellings_are_refused(fake_gpus, device):
    fake_gpus(2)
    with pytest.raises(UserError, match=f"--device {device}: expected 'cpu', 'cuda' or CUDA indices"):
        dist.select_device(device, 16, DistInfo())


def test_cpu_needs_no_cuda(fake_gpus):
    fake_gpus(2)
    assert dist.select_device("cpu", 16, node(3)) == torch.device("cpu")


@pytest.mark.cuda
def test_select_device_on_a_real_gpu():
    n = torch.cuda.device_count()
    assert dist.select_device("", 0, DistInfo()) == torch.device("cuda", 0)
    assert dist.select_device("cuda", 0, DistInfo()) == torch.device("cuda", 0)
    last = dist.select_device(f"cuda:{n - 1}", 0, DistInfo())
    assert last == torch.device("cuda", n - 1) and torch.cuda.current_device() == n - 1
    assert dist.select_device("", 0, node(0, ranks=n)) == torch.device("cuda", 0)
    with pytest.raises(UserError, match="listed more than once"):
        dist.select_device("0,0", 0, DistInfo())
    torch.cuda.set_device(0)
