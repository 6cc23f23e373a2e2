"""The crop-in-the-workers side of ``CachedImageDataset`` (``crop=``, ``flip=``, ``seed=``): the epoch and
output size the workers crop for, and the gather that crops each sample straight into the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.worker_crop import CenterCrop, CropControl, CropSpec, RandomResizedCrop, _size2, gather_cropped

__all__ = ["WorkerCropMixin"]


class WorkerCropMixin:
    """Mixed into :class:`~loaders.dataset.CachedImageDataset`; uses its reader (``_images``, ``_shared``,
    ``shape``, ``_indices``, ``_boxes_at``, ``_check_process``)."""

    crop: CropSpec | None
    flip_p: float
    crop_seed: int
    _control: CropControl | None

    def set_crop(self, crop: CropSpec | None, flip: bool | float = False, seed: int = 0) -> None:
        """Set (or clear, with None) the constructor's ``crop``, ``flip`` and ``seed``; before making loaders."""
        if crop is not None and not isinstance(crop, (RandomResizedCrop, CenterCrop)):
            raise TypeError(f"crop must be a loaders.worker_crop RandomResizedCrop or CenterCrop, got {crop!r} "
                            "(the device transforms of loaders.transforms run on the batch, not here)")
        flip_p = 0.5 if flip is True else float(flip)
        if not 0.0 <= flip_p <= 1.0:
            raise ValueError(f"flip must be a bool or a probability in [0, 1], got {flip!r}")
        if flip_p and not isinstance(crop, RandomResizedCrop):
            raise ValueError("flip needs crop=RandomResizedCrop(...): eval crops do not flip")
        self.crop = crop
        self.flip_p = flip_p
        self.crop_seed = int(seed)
        self._control = CropControl(_size2(crop.size)) if crop is not None else None

    # ------------------------------------------------------------------ crop in the workers
    def set_epoch(self, epoch: int) -> None:
        """The epoch the crop boxes and flips are drawn for (seen by persistent workers at their next batch)."""
        if self._control is not None:
            self._control.set(epoch=int(epoch))

    def set_resolution(self, size: int | Sequence[int]) -> None:
        """Output size of the crop from the next batch on (progressive resizing); call between epochs."""
        if self._control is None:
            raise ValueError("set_resolution needs a dataset made with crop=RandomResizedCrop(...) or CenterCrop(...)")
        self._control.set(size=_size2(size))

    @property
    def resolution(self) -> tuple[int, int] | None:
        """(h, w) of the batches' images under ``crop``; None without one."""
        return None if self._control is None else self._control.size

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """(H, W, 3) of a sample as batches carry it: the crop size under ``crop``, else :attr:`shape`."""
        ds: Any = self  # the dataset's own attributes
        if self._control is None:
            return ds.shape
        return (*self._control.size, 3)

    def gather_cropped(self, indices: Sequence[int] | np.ndarray, out: np.ndarray) -> np.ndarray:
        """Samples ``indices`` cropped (``crop``) into ``out`` uint8 (B, h, w, 3); the size is ``out``'s."""
        if self.crop is None or self._control is None:
            raise ValueError("gather_cropped needs a dataset made with crop=...")
        ds: Any = self  # the dataset's reader
        idx = ds._indices(indices)
        if out.ndim != 4 or out.shape[0] != len(idx) or out.shape[3] != 3 or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8[{len(idx)}, h, w, 3], got {out.dtype}{list(out.shape)}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if len(idx) == 0:
            return out
        ds._check_process()
        shared = ds._shared.numpy() if ds._shared is not None else None
        gather_cropped(ds._images, shared, ds.shape, idx, ds._boxes_at(idx), self.crop,
                       self.flip_p, self.crop_seed, self._control.epoch, out)
        return out

    def load_batch(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """What a batch holds: :meth:`gather_cropped` under ``crop``, else :meth:`gather`."""
        ds: Any = self
        return ds.gather(idx, out) if self.crop is None else self.gather_cropped(idx, out)

    def _boxes_out(self, idx: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Boxes a batch carries: the stored valid boxes, or the whole output once cropped inside them."""
        if self.crop is None:
            ds: Any = self
            return ds._boxes_at(idx)
        return np.tile(np.array([0, 0, shape[1], shape[2]], dtype=np.int32), (len(idx), 1))

