"""A real ``lightning.Trainer`` over a :class:`loaders.lightning.CacheDataModule`, recording which samples each
rank trains on (the test caches encode their index in their pixels). Imported by tests/test_lightning.py
for one process, and run as a script for DDP (Lightning's launcher starts the other rank by running this
file again)::

    python tests/lightning_run.py CACHE OUT --devices 2 [--ckpt PATH] [--save-every K]

writes ``OUT/rank{r}.json``: ``{"seen": [[epoch, [indices...]], ...], "val": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: make this checkout importable (tests.*, loaders.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from loaders.lightning import CacheDataModule
from tests.loaders_fixtures import decode_index

__all__ = ["Recorder", "SaveAt", "fit"]


class Recorder(pl.LightningModule):
    """A linear probe that records the index of every sample it trains and validates on."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, num_classes)
        self.seen: list[tuple[int, list[int]]] = []
        self.val_seen: list[int] = []
        self.batches: list[tuple[torch.dtype, tuple[int, ...], torch.dtype, tuple[int, ...]]] = []

    def _indices(self, x: torch.Tensor) -> list[int]:
        return decode_index(x.permute(0, 2, 3, 1).cpu().numpy()).tolist()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        self.batches.append((x.dtype, tuple(x.shape), y.dtype, tuple(y.shape)))
        if x.dtype == torch.uint8:
            self.seen.append((self.current_epoch, self._indices(x)))
        logits = self.lin(x.float().mean((2, 3)))
        return F.cross_entropy(logits, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x = batch[0]
        if x.dtype == torch.uint8:
            self.val_seen.extend(self._indices(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveAt(Callback):
    """``trainer.save_checkpoint(out/step=K.ckpt)`` after every K-th training step (as ModelCheckpoint's
    ``every_n_train_steps`` does, without its bookkeeping, which warns on resume)."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            trainer.save_checkpoint(self.out / f"step={trainer.global_step}.ckpt")


def fit(dm: CacheDataModule, out: Path | None = None, *, devices: int = 1, epochs: int = 2,
        ckpt: str | None = None, save_every: int = 0, model: Recorder | None = None, **trainer_kw: Any) -> Recorder:
    """Train ``epochs`` epochs (resuming from ``ckpt``); ``save_every`` > 0 saves ``out/step=K.ckpt`` every K steps."""
    model = model or Recorder()
    callbacks = []
    if save_every:
        assert out is not None
        callbacks.append(SaveAt(out, save_every))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_epochs=epochs, logger=False, enable_checkpointing=False,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, log_every_n_steps=1, **trainer_kw)
    trainer.fit(model, dm, ckpt_path=ckpt)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        record = {"seen": model.seen, "val": model.val_seen, "world": trainer.world_size}
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cache")
    p.add_argument("out", type=Path)
    p.add_argument("--val")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--ckpt")
    p.add_argument("--save-every", type=int, default=0)
    a = p.parse_args()
    dm = CacheDataModule(a.cache, a.val, batch_size=a.batch_size, num_workers=a.workers, seed=3)
    fit(dm, a.out, devices=a.devices, ckpt=a.ckpt, save_every=a.save_every)


if __name__ == "__main__":
    main()
