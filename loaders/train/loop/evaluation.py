"""``evaluate``: loss, top-1 and top-5 of a model on batches, summed over DDP ranks; and the small
helpers the training loop shares with it (model device, main logits, progress bar)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from loaders.train.distributed import all_reduce_sum
from loaders.train.loop.amp import autocast

__all__ = ["Transform", "evaluate"]

Transform = Callable[..., torch.Tensor]  # x -> x, or (x, boxes) -> x where the loader yields valid boxes


def model_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def unwrap_logits(out: Any) -> torch.Tensor:
    # Inception / GoogLeNet return (logits, aux...) in train mode; the main logits come first.
    return out if isinstance(out, torch.Tensor) else out[0]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
             transform: Transform | None = None, amp_dtype: torch.dtype | None = None,
             device: torch.device | str | None = None, progress: bool = False) -> dict[str, float]:
    """Loss, top-1 and top-5 accuracy (fractions) of ``model`` on ``batches``, summed over DDP ranks.

    Under DDP give each rank a disjoint share of the samples (no padding): the counts are summed,
    so each sample is counted once. Top-5 becomes top-C for fewer than five classes.
    """
    device = torch.device(device) if device is not None else model_device(model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # summed here, divided by the global count below
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1, top5, count
    n = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    bar = progress_bar(progress, n, 0, "val")
    try:
        for batch in batches:
            x = batch[0].to(device, non_blocking=True)
            y = batch[1].to(device, non_blocking=True)
            if transform is not None:
                x = transform(x, batch[2]) if len(batch) > 2 else transform(x)
            with autocast(device, amp_dtype):
                logits = unwrap_logits(model(x))
            logits = logits.float()
            k = min(5, logits.shape[1])
            top = logits.topk(k, dim=1).indices
            hit = top == (y.argmax(1) if y.is_floating_point() else y)[:, None]  # soft labels: their top class
            totals[0] += loss_fn(logits, y).double()
            totals[1] += hit[:, 0].sum()
            totals[2] += hit.any(dim=1).sum()
            totals[3] += len(y)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    all_reduce_sum(totals)
    count = float(totals[3])
    if count == 0:
        return {"loss": math.nan, "top1": math.nan, "top5": math.nan, "count": 0}
    return {
        "loss": float(totals[0]) / count,
        "top1": float(totals[1]) / count,
        "top5": float(totals[2]) / count,
        "count": int(count),
    }


def progress_bar(enabled: bool, total: int | None, initial: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)
