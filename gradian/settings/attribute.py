"""The attribute stage's schema (`attribute.*`): the eval set, the query loss, the engines, the counts.

Its choices are the one list of query losses and engines: `gradian.attribute.queries.QUERY_LOSSES`
and `gradian.attribute.engines.ENGINES` read them (`choices(AttributeConfig, "engines")`), and
`gradian attribute`'s flags that mirror a key take their default, help, choices and range from its
field (`circuitkit.core.config.add_schema_flag`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from circuitkit.core.config import _f


@dataclass
class AttributeConfig:
    eval_path: Optional[str] = _f(None, "the attribute stage (after grads; not in the default stages): a JSONL of"
                                  " {prompt, completion} eval items, the completion being the answer, on which the"
                                  " tuned model (model.name with model.adapter, or a full fine-tune with"
                                  " model.base_name) is compared with its base model; the training rows of this run's"
                                  " index that caused the regression are accused (gradian attribute). Required when"
                                  " stages lists attribute; null = none")
    query_loss: str = _f("contrastive", "the regressed items' query gradient: contrastive = ∇[ℓ(answer) − ℓ(what the"
                         " tuned model says)], ce = ∇ℓ(answer), margin = ∇ of the answer tokens' negated log-odds",
                         choices=("contrastive", "ce", "margin"))
    engines: list[str] = _f(["auto"], "scoring engines, the first accuses and the others report their rank"
                            " agreement with it: auto = gradian rank's default score for the index (ekfac with"
                            " K-FAC factors, else cosine); tracin, tracin-dot = TracIn across the fine-tune's checkpoints"
                            " (attribute.checkpoints)", choices=("auto", "dot", "cosine", "influence", "kfac", "ekfac",
                                                                 "datainf", "tracin", "tracin-dot"))
    top_k: int = _f(40, "training rows accused (most negative score first)", ge=1, le=100_000)
    bootstrap: int = _f(2000, "paired bootstrap resamples of the regression's 95 % interval (seeded with the"
                        " top-level seed)", ge=100, le=1_000_000)
    thin_margin: float = _f(1.0, "nats: a flipped item whose base margin was below this, and that the tuned model"
                            " gets wrong by less than this, counts toward base-model blame", ge=0.0)
    span_min_tokens: int = _f(64, "accused rows with at least this many supervised tokens get one gradient per"
                              " sentence (the drill-down); 0 = none", ge=0)
    precision: str = _f("index", "the dtype the base and tuned models are evaluated in (the regression and the flipped"
                        " items): index = the precision the index was built with (gradian index's model.precision as"
                        " resolved); auto = bfloat16 where the device computes it natively, else float32; or"
                        " float32, bfloat16, float16 to match your own eval. The query gradients always run in the"
                        " index's precision (the rows' weights). Flipped items are re-scored in float32 (bfloat16"
                        " when float32 was used) and marked near-tie when their flip depends on it",
                        choices=("index", "auto", "float32", "bfloat16", "float16"))
    checkpoints: Optional[str] = _f(None, "the fine-tune's checkpoints for the tracin engines (gradian attribute"
                                    " --checkpoints): its Hugging Face Trainer output directory (checkpoint-*/ LoRA"
                                    " adapters, learning rates from trainer_state.json) or a comma list of adapter"
                                    " directories; each gets its own index under the run's index dir (checkpoints/),"
                                    " reused on rerun. null = none (the tracin engines are then refused)")
    checkpoint_lrs: Optional[list[float]] = _f(None, "the learning rate of each checkpoint, in order (gradian attribute"
                                               " --checkpoint-lrs); null = trainer_state.json's, else equal weights")
