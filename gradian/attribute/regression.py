"""The regression, measured: how much worse the tuned model is than its base on the eval set, with a
paired bootstrap confidence interval, which items flipped, and which the base model is the likelier
culprit for.

Per item i, c_i = 1 when greedy decoding reproduces the answer (`ItemScores.exact`). The regression
is the accuracy drop

    Δ = mean_i (c_i^base - c_i^tuned)

and, beside it, the mean log-probability drop mean_i (logprob_i^base - logprob_i^tuned) (nats).
Both have a paired bootstrap interval: B resamples of the n items with replacement (the same
items for both models, so what the items share cancels), from a seeded numpy generator, the
interval the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of the resampled means.
There is something to attribute only when the accuracy interval lies above 0; an interval that
holds 0 is inside the noise band (and one below 0 means the tuned model is better).

Flipped items went right -> wrong (c^base = 1, c^tuned = 0); they are the regressed items whose
query gradients rank the training rows. The base model is the likelier culprit for items the
tuned model gets wrong that the base model got wrong already, and for flipped items whose base
margin (`gradian.attribute.evaluate`: the weakest answer step's log p(answer) - log p(best other))
was below `THIN_MARGIN` nats: knowledge that thin was one small push away from flipping.

A flipped item is a near-tie when its flip depends on the precision: scored in the other precision
(`gradian.attribute.precision`), its base margin is below `NEAR_TIE` nats (the base model was not
surely right) or its tuned margin above -`NEAR_TIE` (the tuned model not surely wrong).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gradian.attribute.evaluate import ItemScores

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
THIN_MARGIN = 1.0  # nats: a base margin below this is thin (e^1: the answer was < 2.7x as likely as the runner-up)
# nats: a flipped item's margin within this of 0 in the other precision is a near-tie; bfloat16 logits of
# magnitude 8 to 16 are 1/16 apart, so a margin that close is inside one rounding step of a 16-bit head
NEAR_TIE = 0.1


def paired_bootstrap(diffs: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                     confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high) percentile interval of mean(diffs) over `resamples` resamples of the items
    (diffs (n,), one paired difference per item) with replacement, from numpy's PCG64 seeded with
    `seed`: the same seed gives the same interval."""
    diffs = np.asarray(diffs, dtype=np.float64)
    if diffs.ndim != 1 or len(diffs) == 0:
        raise ValueError(f"paired_bootstrap needs a non-empty 1-D array of differences, got shape {diffs.shape}.")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, 2**22 // len(diffs))  # resamples drawn at once: a (step, n) index array of <= 32 MiB
    for s in range(0, resamples, step):
        take = min(step, resamples - s)
        means[s:s + take] = diffs[rng.integers(0, len(diffs), size=(take, len(diffs)))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass
class Regression:
    """The measured regression (see the module docstring); item lists are 0-based item numbers."""

    n_items: int
    base_accuracy: float
    tuned_accuracy: float
    accuracy_drop: float
    accuracy_ci: tuple[float, float]
    base_first_token_accuracy: float
    tuned_first_token_accuracy: float
    logprob_drop: float  # mean over items of base - tuned answer log-probability (nats)
    logprob_ci: tuple[float, float]
    flipped: list[int]  # right -> wrong: the regressed items
    fixed: list[int]  # wrong -> right
    seed: int
    resamples: int
    confidence: float
    significant: bool  # the accuracy interval lies above 0
    reason: str  # one sentence: why there is (or is not) something to attribute

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["accuracy_ci"], d["logprob_ci"] = list(self.accuracy_ci), list(self.logprob_ci)
        return d


def measure_regression(base: ItemScores, tuned: ItemScores, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = CONFIDENCE) -> Regression:
    """The regression of `tuned` against `base` on the same items (module docstring)."""
    b, t = base.exact.numpy(), tuned.exact.numpy()
    acc_diff = b.astype(np.float64) - t.astype(np.float64)
    lp_diff = base.logprob.numpy() - tuned.logprob.numpy()
    acc_ci = paired_bootstrap(acc_diff, resamples, seed, confidence)
    lp_ci = paired_bootstrap(lp_diff, resamples, seed, confidence)
    flipped = np.flatnonzero(b & ~t).tolist()
    fixed = np.flatnonzero(~b & t).tolist()
    drop = float(acc_diff.mean())
    pct = f"{100 * confidence:g} %"
    span = f"{drop:+.3f} ({pct} CI [{acc_ci[0]:+.3f}, {acc_ci[1]:+.3f}] over {len(b)} items)"
    if acc_ci[0] > 0:
        significant = True
        reason = (f"the tuned model's accuracy is lower by {span}: {len(flipped)} item(s) flipped right -> wrong,"
                  f" {len(fixed)} wrong -> right.")
    elif acc_ci[1] < 0:
        significant = False
        reason = (f"the tuned model is better, not worse: its accuracy drop is {span}; there is no regression to"
                  " attribute.")
    else:
        significant = False
        reason = (f"the accuracy drop {span} is inside the noise band (the interval holds 0): nothing to"
                  f" attribute ({len(flipped)} item(s) flipped right -> wrong, {len(fixed)} wrong -> right).")
    return Regression(n_items=len(b), base_accuracy=base.accuracy, tuned_accuracy=tuned.accuracy,
                      accuracy_drop=drop, accuracy_ci=acc_ci,
                      base_first_token_accuracy=float(base.first.double().mean()),
                      tuned_first_token_accuracy=float(tuned.first.double().mean()),
                      logprob_drop=float(lp_diff.mean()), logprob_ci=lp_ci, flipped=flipped, fixed=fixed,
                      seed=seed, resamples=resamples, confidence=confidence, significant=significant, reason=reason)


@dataclass
class BaseBlame:
    """Items the base model is the likelier culprit for (0-based item numbers)."""

    tuned_wrong: int  # items the tuned model gets wrong
    base_wrong_too: list[int]  # of those, wrong in the base model already
    thin_flipped: list[int]  # flipped items with base margin < thin_margin and tuned margin > -thin_margin
    thin_margin: float
    summary: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def base_blame(base: ItemScores, tuned: ItemScores, thin_margin: float = THIN_MARGIN) -> BaseBlame:
    """Which of the tuned model's wrong items the base model is the likelier culprit for: those it got
    wrong already, and flipped items that were a coin flip on both sides (base margin below
    `thin_margin`, and the tuned model wrong by less than `thin_margin`). A flipped item the tuned
    model gets confidently wrong (its margin at or below -thin_margin) was pushed by the fine-tune,
    however thin the base margin: on SmolLM2's planted yardstick 20 of 35 flipped items had thin
    base margins, and every one of them repeated the planted mistake."""
    b, t = base.exact.numpy(), tuned.exact.numpy()
    wrong = np.flatnonzero(~t)
    already = np.flatnonzero(~b & ~t).tolist()
    flipped = b & ~t
    thin = np.flatnonzero(flipped & (base.margin.numpy() < thin_margin)
                          & (tuned.margin.numpy() > -thin_margin)).tolist()
    n_flipped = int(flipped.sum())
    summary = (f"the base model is the likelier culprit for {len(already) + len(thin)} of the tuned model's"
               f" {len(wrong)} wrong item(s): {len(already)} were wrong before tuning, {len(thin)} of the"
               f" {n_flipped} flipped item(s) were a coin flip (base margin < {thin_margin:g} nats, and the tuned"
               f" model wrong by less than that).")
    return BaseBlame(len(wrong), already, thin, thin_margin, summary)


def near_ties(flipped: list[int], base_other: ItemScores, tuned_other: ItemScores,
              eps: float = NEAR_TIE) -> list[int]:
    """The flipped items (0-based item numbers) that are near-ties: `base_other` and `tuned_other` score
    the flipped items, in `flipped`'s order, in the other precision; an item is a near-tie when there its
    base margin is below `eps` or its tuned margin above -`eps` (module docstring)."""
    if len(base_other.margin) != len(flipped) or len(tuned_other.margin) != len(flipped):
        raise ValueError(f"near_ties: {len(flipped)} flipped items but {len(base_other.margin)} base and"
                         f" {len(tuned_other.margin)} tuned scores.")
    tie = (base_other.margin < eps) | (tuned_other.margin > -eps)
    return [item for item, t in zip(flipped, tie.tolist(), strict=True) if t]
