"""Page-locking the loader's reused batch buffers where they lie, for CUDA runs.

A CUDA run copies each batch to the GPU from page-locked host memory. The DataLoader's pin thread makes
that memory by copying the whole batch, one pass over its bytes in one thread of the training process,
which caps the batches a GPU receives. A batch written into one of the loader's reused buffers
(utils/data/batch.py, BatchMemory) is instead locked where it lies, once per buffer (cudaHostRegister):
every later batch written into that buffer arrives page-locked, and pinning it costs nothing.

Page-locked memory belongs to the process, so the registry does too: it keeps each locked buffer
mapped, which also makes a worker's shared buffer arrive at the same address every time it is sent
(torch maps a shared file once while it is held), and it lets go of the least recently seen buffer
past ``LIMIT`` (a ring that grew for a larger rect batch leaves its old buffers behind).
"""
from __future__ import annotations

import atexit
import threading
from collections import OrderedDict

import torch

from yolotrain.utils.core.logging import LOGGER

LIMIT = 96  # locked buffers per process: training's and validation's rings (workers x slots), with room to grow


class PageLocks:
    """The buffers this process has page-locked, by address, least recently seen first."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._held: OrderedDict[int, torch.UntypedStorage] = OrderedDict()
        self._mutex = threading.Lock()  # the pin threads of a training and a validation loader
        self._unavailable = False

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, address: int) -> bool:
        return address in self._held

    def lock(self, tensor: torch.Tensor) -> bool:
        """Page-lock the whole buffer under ``tensor`` unless it already is; False where CUDA refuses (the
        caller copies instead, as pinning always did)."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        with self._mutex:
            if address in self._held:  # held, so mapped: no other buffer can lie at this address
                self._held.move_to_end(address)
                return True
            if self._unavailable:
                return False
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(address, storage.nbytes(), 0)
            if error != cudart.cudaError.success:
                self._unavailable = True
                LOGGER.warning(f"WARNING: page-locking the loader's batch memory in place failed "
                               f"({cudart.cudaGetErrorString(error)}); each batch is copied into pinned memory instead")
                return False
            if not self._held:
                atexit.register(self.release_all)  # unlock before the mappings go at interpreter exit
            self._held[address] = storage
            while len(self._held) > self.limit:
                self._release(next(iter(self._held)))
            return True

    def release_all(self) -> None:
        """Unlock every buffer (at exit; the driver would drop them with the process anyway)."""
        with self._mutex:
            for address in list(self._held):
                try:
                    self._release(address)
                except RuntimeError:  # CUDA already shut down
                    self._held.pop(address, None)

    def _release(self, address: int) -> None:
        """Unlock and unmap a buffer once no copy from it can be pending."""
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(address)
        del self._held[address]


PAGE_LOCKS = PageLocks()  # this process's, as page-locked memory is
