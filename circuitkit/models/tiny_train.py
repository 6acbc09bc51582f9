"""Induction data, head-pattern scores and the trained ``induction`` fixture.

Why the data looks the way it does: a 2-layer attention-only model trained on "BOS + random
symbols + the same symbols again" reaches ~97 % accuracy with a *positional* shortcut (heads
that look back a fixed distance) and never forms induction heads. Here every sequence holds
several copied segments at lags drawn from a wide range (default 4..100) with fresh filler
between them, so only "find the earlier occurrence of the current token and predict what
followed it" works. Tokens are drawn without replacement except for the copies, so every
predictable position has exactly one earlier occurrence and an unambiguous answer.

The trained fixture (``build_induction_fixture``) is checked from attention patterns on
held-out data before it is saved; ``train_induction`` documents the training choices
(a few "A B A B" pairs, position offsets once the circuit appears, a sparsity prior that puts
the circuit in one head per layer). Measured here: 550 steps, ~30 s on 2 cores, held-out
accuracy 0.976, previous-token head L0H2 0.916, induction head L1H1 0.925.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Symbols used by the induction fixture: 400 ids of merged (multi-byte) BPE tokens, clear of
# the special tokens and the single-byte alphabet at the start of the vocabulary.
SYMBOL_RANGE = (300, 700)


def default_symbols() -> torch.Tensor:
    """Token ids the induction fixture was trained on, shape ``[400]`` (int64)."""
    return torch.arange(*SYMBOL_RANGE)


def _python_rng(generator: torch.Generator | None) -> random.Random:
    # The per-sequence layout is a short scalar loop: Python's RNG is much faster there than
    # torch ops, and seeding it from the torch generator keeps one source of randomness.
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return random.Random(seed)


def induction_batch(
    n: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    symbols: torch.Tensor | Sequence[int] | None = None,
    bos_id: int = 0,
    n_segments: int = 8,
    seg_len: tuple[int, int] = (3, 10),
    lag: tuple[int, int] = (4, 100),
    p_adjacent: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences with repeated segments at widely varying lags, for training and evaluation.

    Each row is ``BOS`` followed by distinct symbols, except that up to ``n_segments`` spans
    of ``seg_len`` (inclusive range) tokens are copies of earlier spans ``lag`` (inclusive
    range, uniform) positions back. Sources and copies never overlap each other, so every
    token occurs at most twice and each predictable position has exactly one earlier
    occurrence. With probability ``p_adjacent`` a segment is instead an "A B A B" pair
    (length 2, lag 2), whose answer is the previous token (training uses a few of these).

    Args:
        n: number of sequences.
        seq_len: tokens per sequence (including BOS); must not exceed ``len(symbols)``.
        generator: torch RNG that drives everything (reproducible for a given state).
        symbols: candidate token ids; defaults to ``default_symbols()``.

    Returns:
        ``input_ids`` ``[n, seq_len]`` int64 and ``mask`` ``[n, seq_len]`` bool where
        ``mask[b, i]`` is True iff token ``i + 1`` is predictable by induction from position
        ``i`` (``i`` and ``i + 1`` lie in the same copied segment). The last column is False.
    """
    syms = [int(s) for s in (default_symbols() if symbols is None else symbols)]
    if seq_len > len(syms):
        raise ValueError(f"seq_len {seq_len} needs at least as many symbols, got {len(syms)}")
    if not 1 <= lag[0] <= lag[1] or not 2 <= seg_len[0] <= seg_len[1]:
        raise ValueError(f"bad lag range {lag} or seg_len {seg_len}")
    rng = _python_rng(generator)
    ids = torch.empty(n, seq_len, dtype=torch.long)
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    for b in range(n):
        toks = rng.sample(syms, seq_len)
        toks[0] = bos_id
        used = [False] * seq_len  # a source or a copy already: spans must stay disjoint
        used[0] = True
        row_mask = [False] * seq_len
        for _ in range(n_segments):
            if rng.random() < p_adjacent:
                length, gap = 2, 2
            else:
                length = rng.randint(*seg_len)
                gap = rng.randint(max(lag[0], length), lag[1])
            if gap + 1 > seq_len - length:
                continue
            for _attempt in range(10):  # rejection sampling of a free (source, copy) pair
                dst = rng.randint(gap + 1, seq_len - length)
                src = dst - gap
                if not any(used[src : src + length]) and not any(used[dst : dst + length]):
                    break
            else:
                continue
            toks[dst : dst + length] = toks[src : src + length]
            for k in range(length):
                used[src + k] = used[dst + k] = True
            for k in range(length - 1):
                row_mask[dst + k] = True
        ids[b] = torch.tensor(toks)
        mask[b] = torch.tensor(row_mask)
    return ids, mask


def _attention_patterns(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention probabilities ``[batch, n_layers, n_heads, query, key]`` from eager attention."""
    # SDPA / flash kernels do not return probabilities; switch to eager for this forward only.
    previous = getattr(model.config, "_attn_implementation", None)
    was_training = model.training
    model.set_attn_implementation("eager")
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    finally:
        model.train(was_training)
        if previous is not None and previous != "eager":
            model.set_attn_implementation(previous)
    return torch.stack([a.float() for a in out.attentions], dim=1)


def head_pattern_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    induction_mask: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Previous-token and induction scores of every attention head.

    * previous-token score of head (l, h): mean attention from position ``i`` to ``i - 1``
      over all non-padding ``i >= 1``;
    * induction score: mean attention from a position ``i`` whose token occurred exactly once
      before, at ``j`` (with ``j + 1 < i``), to ``j + 1``; restricted to ``induction_mask``
      (``[batch, seq]`` bool, e.g. the mask of ``induction_batch``) when given.

    Args:
        model: a Hugging Face causal LM (any family; attention is switched to eager briefly).
        input_ids: ``[batch, seq]`` int64.
        attention_mask: optional ``[batch, seq]`` padding mask (1 = real token).

    Returns:
        ``{"prev_token": [n_layers, n_heads], "induction": [n_layers, n_heads]}`` float32
        tensors, plus ``"n_induction_positions"`` (int) and ``"best_prev_token"`` /
        ``"best_induction"``: ``(layer, head, score)`` of the highest-scoring head.
    """
    pat = _attention_patterns(model, input_ids, attention_mask)  # [b, l, h, q, k]
    seq = input_ids.shape[1]
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    pos = torch.arange(1, seq)
    prev_ok = (valid[:, 1:] & valid[:, :-1]).float()  # [b, seq-1]
    prev_att = pat[:, :, :, pos, pos - 1]  # [b, l, h, seq-1]
    prev = (prev_att * prev_ok[:, None, None]).sum((0, 3)) / prev_ok.sum().clamp_min(1)

    # earlier[b, i, j]: token j equals token i and j < i (both real tokens).
    earlier = (input_ids[:, :, None] == input_ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril(-1)
    earlier &= valid[:, :, None] & valid[:, None, :]
    first = earlier.float().argmax(-1)  # position of the first earlier occurrence
    usable = (earlier.sum(-1) == 1) & (first + 1 < torch.arange(seq)) & valid
    if induction_mask is not None:
        usable &= induction_mask.bool()
    b_idx, i_idx = torch.nonzero(usable, as_tuple=True)
    if len(b_idx):
        induction = pat[b_idx, :, :, i_idx, first[b_idx, i_idx] + 1].mean(0)  # [l, h]
    else:
        induction = torch.zeros_like(prev)

    def best(scores: torch.Tensor) -> tuple[int, int, float]:
        flat = int(scores.argmax())
        return flat // scores.shape[1], flat % scores.shape[1], float(scores.max())

    return {
        "prev_token": prev,
        "induction": induction,
        "n_induction_positions": int(len(b_idx)),
        "best_prev_token": best(prev),
        "best_induction": best(induction),
    }


# --------------------------------------------------------------------------- training

PREV_TOKEN_THRESHOLD = 0.8
INDUCTION_THRESHOLD = 0.5
# The heads that are free to carry the circuit (layer 0, layer 1); every other head carries a
# sparsity penalty. Deliberately not head 0, so a downstream bug that defaults to head 0 shows.
CIRCUIT_HEADS = (2, 1)


class _ZeroMLP(nn.Module):
    """Stands in for an all-zero MLP during training: same output (exactly 0), less work."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def make_attention_only_gpt2(
    vocab_size: int, bos_id: int, pad_id: int, seed: int, d_model: int = 64, n_heads: int = 4,
    n_positions: int = 256,
) -> nn.Module:
    """A 2-layer GPT-2 whose MLP weights and biases are zero and frozen (MLP output == 0)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=d_model, n_layer=2, n_head=n_heads,
        n_inner=4 * d_model, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=bos_id, eos_token_id=bos_id, pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    for block in model.transformer.h:
        for p in block.mlp.parameters():
            p.data.zero_()
            p.requires_grad_(False)
    return model.float()


def _head_group_norms(attn: nn.Module, heads: Sequence[int], with_qkv: bool) -> torch.Tensor:
    """Frobenius norm of each listed head's parameters in a GPT-2 attention block.

    ``c_proj.weight`` is ``[n_embd (concatenated heads), n_embd]`` (Conv1D), so a head owns a
    block of rows; ``c_attn`` is ``[n_embd, 3 * n_embd]`` with Q | K | V column blocks, each
    split by head. ``with_qkv`` adds the head's Q, K, V columns and biases to its output rows.
    """
    d = attn.c_proj.weight.shape[0]
    dh = d // attn.num_heads
    norms = []
    for h in heads:
        rows = slice(h * dh, (h + 1) * dh)
        parts = [attn.c_proj.weight[rows].flatten()]
        if with_qkv:
            for k in range(3):
                cols = slice(k * d + h * dh, k * d + (h + 1) * dh)
                parts += [attn.c_attn.weight[:, cols].flatten(), attn.c_attn.bias[cols]]
        norms.append(torch.cat(parts).norm())
    return torch.stack(norms)


def evaluate_induction(
    model: nn.Module, n: int, seq_len: int, seed: int, symbols: torch.Tensor | None = None,
    bos_id: int = 0,
) -> dict[str, Any]:
    """Accuracy and head scores on fresh ``induction_batch`` data (lags 4..100, no A B A B).

    Accuracy is the full-vocabulary argmax at the predictable positions (``mask``).
    """
    gen = torch.Generator().manual_seed(seed)
    ids, mask = induction_batch(n, seq_len, gen, symbols=symbols, bos_id=bos_id)
    scores = head_pattern_scores(model, ids, induction_mask=mask)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    correct = (logits[:, :-1].argmax(-1) == ids[:, 1:])[mask[:, :-1]]
    return {"accuracy": float(correct.float().mean()), "n_predictable": int(correct.numel()), **scores}


def _circuit_is_clean(scores: dict[str, Any], acc: float, circuit: tuple[int, int],
                      stop_at: tuple[float, float, float, float]) -> bool:
    """Stop rule: strong, accurate, and carried by the circuit heads alone."""
    prev, ind = scores["prev_token"][0], scores["induction"][1]
    others_prev = torch.cat([prev[: circuit[0]], prev[circuit[0] + 1 :]])
    others_ind = torch.cat([ind[: circuit[1]], ind[circuit[1] + 1 :]])
    return bool(
        prev[circuit[0]] >= stop_at[0] and ind[circuit[1]] >= stop_at[1] and acc >= stop_at[2]
        and others_prev.max() < stop_at[3] and others_ind.max() < stop_at[3]
    )


def train_induction(
    vocab_size: int,
    bos_id: int,
    pad_id: int,
    seed: int,
    *,
    d_model: int = 64,
    n_heads: int = 4,
    n_positions: int = 256,
    seq_len: int = 128,
    batch_size: int = 64,
    lr: float = 3e-3,
    max_steps: int = 3000,
    eval_every: int = 50,
    n_segments: int = 12,
    seg_len: tuple[int, int] = (3, 16),
    p_adjacent: float = 0.1,
    circuit_heads: tuple[int, int] = CIRCUIT_HEADS,
    sparsity: tuple[float, float] = (3e-3, 3e-2),
    stop_at: tuple[float, float, float, float] = (0.85, 0.6, 0.95, 0.3),
    threads: int = 2,
    symbols: torch.Tensor | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train an attention-only 2-layer GPT-2 on ``induction_batch`` data until the circuit forms.

    Loss: cross-entropy at the predictable positions only, over the symbol set (the tied
    embedding rows of ``symbols``); other positions carry no signal. Every ``eval_every``
    steps a fixed evaluation batch is scored; training stops when the layer-0 circuit head's
    previous-token score, the layer-1 circuit head's induction score and the accuracy reach
    ``stop_at[:3]`` while every other head scores below ``stop_at[3]`` (or at ``max_steps``).

    Choices measured on this 2-core CPU (d_model 64, batch 64, seq 128):

    * ``p_adjacent``: a few "A B A B" pairs (answer = previous token) seed the previous-token
      head; 10 % of segments is enough, 30 %+ lets that shortcut win and no induction forms.
    * Phases: with positions 0..seq_len-1 the circuit forms after ~550 steps, but then the
      previous-token head only works where copy *sources* occur, which cluster early in a
      sequence (late positions score ~0). Random position offsets from the start delay the
      formation past 1500 steps; switched on once the induction head appears (score > 0.3),
      they spread the previous-token pattern to every position within ~100 steps.
    * Sparsity: without a prior all four layer-1 heads become identical induction heads, so
      per-head attribution splits the effect four ways. A group-lasso penalty
      (``sparsity[0]`` x the output-projection norm of every non-circuit head, from the start)
      lets the circuit heads win; in phase 2 ``sparsity[1]`` x the norm of their Q, K, V and
      output weights removes what is left, so their patterns fade too.

    Deterministic for fixed arguments (seeded init and data, fixed thread count).

    Returns:
        The trained model (``GPT2LMHeadModel``, MLPs exactly zero) and a dict with ``steps``,
        ``phase2_step``, ``wall_seconds``, ``converged`` and the last evaluation.
    """
    syms = default_symbols() if symbols is None else torch.as_tensor(symbols)
    model = make_attention_only_gpt2(vocab_size, bos_id, pad_id, seed, d_model, n_heads, n_positions)
    penalised = [[h for h in range(n_heads) if h != circuit_heads[layer]] for layer in (0, 1)]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    mlps = [block.mlp for block in model.transformer.h]
    for block in model.transformer.h:
        block.mlp = _ZeroMLP()
    data_gen = torch.Generator().manual_seed(seed + 1)
    eval_ids, eval_mask = induction_batch(32, seq_len, torch.Generator().manual_seed(seed + 2), syms, bos_id)
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[syms] = torch.arange(len(syms))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    start = time.perf_counter()
    phase2_step: int | None = None
    last: dict[str, Any] = {}
    converged = False
    step = 0
    try:
        model.train()
        for step in range(1, max_steps + 1):
            ids, mask = induction_batch(batch_size, seq_len, data_gen, syms, bos_id, n_segments=n_segments,
                                        seg_len=seg_len, lag=(4, 100), p_adjacent=p_adjacent)
            position_ids = None
            if phase2_step is not None:
                offset = torch.randint(0, n_positions - seq_len + 1, (batch_size, 1), generator=data_gen)
                position_ids = offset + torch.arange(seq_len)
            hidden = model.transformer(input_ids=ids, position_ids=position_ids).last_hidden_state
            sel = mask[:, :-1]
            logits = hidden[:, :-1][sel] @ model.lm_head.weight[syms].T
            loss = nn.functional.cross_entropy(logits, remap[ids[:, 1:][sel]])
            for layer, block in enumerate(model.transformer.h):
                loss = loss + sparsity[0] * _head_group_norms(block.attn, penalised[layer], False).sum()
                if phase2_step is not None:
                    loss = loss + sparsity[1] * _head_group_norms(block.attn, penalised[layer], True).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % eval_every == 0:
                model.eval()
                scores = head_pattern_scores(model, eval_ids, induction_mask=eval_mask)
                with torch.no_grad():
                    pred = model(input_ids=eval_ids).logits[:, :-1].argmax(-1)
                acc = float((pred == eval_ids[:, 1:])[eval_mask[:, :-1]].float().mean())
                model.train()
                last = {"step": step, "loss": float(loss.detach()), "accuracy": acc,
                        "prev_token": scores["prev_token"][0].tolist(),
                        "induction": scores["induction"][1].tolist()}
                if phase2_step is None and float(scores["induction"][1].max()) > 0.3:
                    phase2_step = step
                if _circuit_is_clean(scores, acc, circuit_heads, stop_at):
                    converged = True
                    break
    finally:
        for block, mlp in zip(model.transformer.h, mlps, strict=True):
            block.mlp = mlp
        torch.set_num_threads(old_threads)
        model.eval()
    stats = {"steps": step, "phase2_step": phase2_step, "converged": converged,
             "wall_seconds": time.perf_counter() - start, "last_eval": last}
    return model, stats


def build_induction_fixture(directory: Path, tokenizer: Any, seed: int | None = None) -> dict[str, Any]:
    """Train, verify and save the ``induction`` fixture into ``directory``.

    Verification (64 fresh held-out sequences of 128 tokens, eager attention): the best
    layer-0 previous-token score must exceed ``PREV_TOKEN_THRESHOLD`` and the best layer-1
    induction score must exceed ``INDUCTION_THRESHOLD``; otherwise RuntimeError naming them.
    The recorded heads are found from these patterns (argmax), not assumed.

    Returns the dict written to ``fixture_info.json``.
    """
    from circuitkit.models.tiny import FIXTURE_VERSION, fixture_seed, write_fixture_info

    seed = fixture_seed("induction") if seed is None else seed
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    model, stats = train_induction(len(tokenizer), bos, pad, seed)
    held_out = evaluate_induction(model, n=64, seq_len=128, seed=seed + 3, bos_id=bos)
    prev, ind = held_out["prev_token"][0], held_out["induction"][1]
    prev_head, ind_head = int(prev.argmax()), int(ind.argmax())
    prev_score, ind_score = float(prev.max()), float(ind.max())
    if prev_score <= PREV_TOKEN_THRESHOLD or ind_score <= INDUCTION_THRESHOLD:
        raise RuntimeError(
            "induction fixture failed verification on held-out data: best layer-0 previous-token "
            f"score {prev_score:.3f} (head {prev_head}, need > {PREV_TOKEN_THRESHOLD}), best "
            f"layer-1 induction score {ind_score:.3f} (head {ind_head}, need > "
            f"{INDUCTION_THRESHOLD}), accuracy {held_out['accuracy']:.3f} after {stats['steps']} "
            f"steps (converged: {stats['converged']})"
        )
    long_ctx = evaluate_induction(model, n=32, seq_len=256, seed=seed + 4, bos_id=bos)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    info = {
        "name": "induction",
        "fixture_version": FIXTURE_VERSION,
        "seed": seed,
        "family": "gpt2",
        "model_class": type(model).__name__,
        "auto_class": "AutoModelForCausalLM",
        "attention_only": True,
        "mlp": "c_fc/c_proj weights and biases are zero and were frozen in training: MLP output is exactly 0",
        "n_layers": 2,
        "n_heads": model.config.n_head,
        "n_kv_heads": model.config.n_head,
        "d_model": model.config.n_embd,
        "n_positions": model.config.n_positions,
        "vocab_size": len(tokenizer),
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "symbol_range": list(SYMBOL_RANGE),
        "prev_token_head": [0, prev_head],
        "prev_token_score": prev_score,
        "induction_head": [1, ind_head],
        "induction_score": ind_score,
        "accuracy": held_out["accuracy"],
        "eval": {
            "data": "induction_batch(64, 128, torch.Generator().manual_seed(seed + 3), bos_id=bos)",
            "n_predictable": held_out["n_predictable"],
            "prev_token_scores": held_out["prev_token"].tolist(),
            "induction_scores": held_out["induction"].tolist(),
            # Beyond the training length (positions up to 255 were seen via offsets): informative only.
            "accuracy_seq256_untrained_length": long_ctx["accuracy"],
        },
        "train": {
            "steps": stats["steps"],
            "phase2_step": stats["phase2_step"],
            "converged": stats["converged"],
            "wall_seconds": round(stats["wall_seconds"], 2),
            "batch_size": 64,
            "seq_len": 128,
            "lr": 3e-3,
            "circuit_heads_unpenalised": list(CIRCUIT_HEADS),
            "last_eval": stats["last_eval"],
        },
        "thresholds": {"prev_token": PREV_TOKEN_THRESHOLD, "induction": INDUCTION_THRESHOLD},
    }
    write_fixture_info(directory, info)
    return info
