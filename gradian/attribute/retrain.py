"""A plain trainer: a fine-tune redone from its base model on prompt/completion rows. `gradian
attribute --verify` retrains with it without the accused rows; the tests build their planted
fixture with it.

Rows are `gradian.data.rows.Row`s, tokenized under the index's token policy, so the loss covers the
tokens the index's gradients did. With S the supervised positions of a step's rows (completion
tokens, and EOS when the policy appends it):

    loss = (1 / |S|) Σ_{(b,t) ∈ S} CE(softcap(U h_{b,t-1}), input_ids[b, t])

the mean over the batch's supervised tokens: a completion-only loss, as TRL's or the Hugging Face
Trainer's with the prompt's labels at -100. Only the supervised positions are unembedded.

The run, in order:

    torch.manual_seed(seed)   then the LoRA adapter is made (peft draws lora_A from it; lora_B = 0),
                              or, for a full fine-tune, every parameter is set to train
    the step plan             each epoch a permutation of the rows from a generator seeded with `seed`,
                              cut into batches of `batch_size` (an epoch's last batch may be smaller):
                              `steps` batches, or `epochs` x ceil(n_rows / batch_size)
    each step                 AdamW (betas 0.9 / 0.999, eps 1e-8, `weight_decay`), a constant learning
                              rate, no gradient clipping, no accumulation

`save_every` N > 0 writes the adapter after every N-th step (and the last) to
`<save_dir>/checkpoint-<step>/`, with a `trainer_state.json` whose `log_history` logs each step's loss
and learning rate, as the Hugging Face Trainer's output directory holds them (`gradian attribute
--checkpoints` reads it).

Same rows, settings, seed and device: the same weights (on a CPU bit for bit; a GPU's kernels may
round differently between runs). The caller's torch generators are left as they were.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from circuitkit.core.io import atomic_write_json
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from circuitkit.models.lora import new_adapter
from gradian.attribute.evaluate import final_logits, pad_id
from gradian.capture.gradients import supervised_positions
from gradian.data.batch import collate, to_device
from gradian.data.rows import Row

BETAS = (0.9, 0.999)
EPS = 1e-8
DEFAULT_BATCH_SIZE = 8  # the Hugging Face Trainer's per-device default
# adapter_config.json's keys that the record names (the rest of the config is used as it is)
LORA_KEYS = ("r", "lora_alpha", "target_modules", "lora_dropout", "fan_in_fan_out", "use_rslora", "use_dora")


@dataclass(frozen=True)
class TrainSettings:
    """How a fine-tune is (re)made. Exactly one of `steps` (optimizer steps; 0 = the untrained
    adapter) and `epochs` (passes over the rows). `lora`: adapter_config.json's keys of the adapter to
    train (None: a full fine-tune, every weight trains)."""

    lr: float
    batch_size: int = DEFAULT_BATCH_SIZE
    seed: int = 0
    steps: int | None = None
    epochs: int | None = None
    lora: dict[str, Any] | None = field(default=None, compare=False)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give steps or epochs, exactly one (got steps={self.steps}, epochs={self.epochs}).")
        if (self.steps is not None and self.steps < 0) or (self.epochs is not None and self.epochs < 1):
            raise ValueError(f"steps must be >= 0 and epochs >= 1 (got steps={self.steps}, epochs={self.epochs}).")
        if self.batch_size < 1 or not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"batch_size {self.batch_size} (>= 1), lr {self.lr} (> 0), weight_decay"
                             f" {self.weight_decay} (>= 0).")

    def n_steps(self, n_rows: int) -> int:
        """Optimizer steps over `n_rows` rows."""
        return self.steps if self.steps is not None else self.epochs * math.ceil(n_rows / self.batch_size)

    def record(self) -> dict[str, Any]:
        """The settings as the result records them (JSON-ready)."""
        d = {k: v for k, v in asdict(self).items() if k != "lora"}
        lora = None if self.lora is None else {k: self.lora.get(k) for k in LORA_KEYS}
        return {**d, "kind": "full" if self.lora is None else "lora", "lora": lora, "optimizer": "AdamW",
                "betas": list(BETAS), "eps": EPS, "schedule": "constant", "gradient_clipping": None,
                "loss": "mean cross-entropy over the batch's supervised tokens"}


def step_plan(n_rows: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Row numbers of each step's batch: epochs of seeded permutations cut into batches (module docstring)."""
    if n_rows < 1 and steps > 0:
        raise ValueError("there is no row to train on.")
    generator = torch.Generator().manual_seed(seed)
    plan: list[list[int]] = []
    while len(plan) < steps:
        order = torch.randperm(n_rows, generator=generator).tolist()
        plan.extend(order[s:s + batch_size] for s in range(0, n_rows, batch_size))
    return plan[:steps]


def batch_loss(adapter, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy over the batch's supervised tokens (a scalar, float32, with its graph)."""
    hidden = adapter.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    ex, pos, targets = supervised_positions(batch)
    return F.cross_entropy(final_logits(adapter, hidden[ex, pos]), targets)  # (N, V) logits, N supervised


@dataclass
class Trained:
    """A trained model: the Hugging Face model (LoRA linears in place for a LoRA run), peft's wrapper
    of it (None for a full fine-tune), the tokenizer, each step's loss and the wall time."""

    model: nn.Module
    peft_model: nn.Module | None
    tokenizer: Any
    losses: list[float]
    wall_s: float

    def save(self, directory: str | Path) -> Path:
        """The adapter directory (LoRA: adapter_config.json and weights) or the whole model with its
        tokenizer (a full fine-tune), written by save_pretrained."""
        directory = Path(directory)
        if self.peft_model is not None:
            self.peft_model.save_pretrained(directory)
        else:
            self.model.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)
        return directory


def train(model_cfg: ModelConfig, rows: Sequence[Row], settings: TrainSettings,
          device: torch.device | None = None, save_every: int = 0, save_dir: str | Path | None = None,
          bar=None) -> Trained:
    """Fine-tune `model_cfg`'s model (loaded in its precision on `device`) on `rows` (module docstring).
    Returns it frozen and in eval mode. `save_every` > 0: a LoRA adapter checkpoint in `save_dir`
    every that many steps and after the last (module docstring). `bar` (`circuitkit.core.progress.Progress`,
    optional) advances by each optimizer step."""
    if save_every and (settings.lora is None or save_dir is None):
        raise ValueError("save_every needs a LoRA fine-tune (settings.lora) and a save_dir.")
    start = time.perf_counter()
    loaded = load_model(model_cfg, device)
    model = loaded.model
    cuda = [loaded.device.index or 0] if loaded.device.type == "cuda" else []
    losses: list[float] = []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(settings.seed)
        if settings.lora is not None:
            wrapped = new_adapter(model, settings.lora)
        else:
            wrapped = None
            model.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=BETAS, eps=EPS, weight_decay=settings.weight_decay)
        pad = pad_id(loaded.tokenizer)
        model.train()
        plan = step_plan(len(rows), settings.batch_size, settings.n_steps(len(rows)), settings.seed)
        for step, batch_rows in enumerate(plan, start=1):
            batch = to_device(collate([rows[i] for i in batch_rows], pad), loaded.device)
            loss = batch_loss(loaded.adapter, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.advance(1)
            if save_every and (step % save_every == 0 or step == len(plan)):
                _save_checkpoint(wrapped, Path(save_dir), step, losses, settings.lr)
    model.eval()
    model.requires_grad_(False)
    del optimizer, params
    return Trained(model, wrapped, loaded.tokenizer, losses, time.perf_counter() - start)


def _save_checkpoint(peft_model: nn.Module, save_dir: Path, step: int, losses: list[float], lr: float) -> None:
    """`save_dir/checkpoint-<step>/` (the adapter) and `save_dir/trainer_state.json` (the steps so far),
    as a Hugging Face Trainer's output directory: the state is written atomically after the adapter."""
    peft_model.save_pretrained(save_dir / f"checkpoint-{step}")
    history = [{"step": s, "loss": v, "learning_rate": lr} for s, v in enumerate(losses, start=1)]
    atomic_write_json(save_dir / "trainer_state.json", {"global_step": step, "log_history": history})
