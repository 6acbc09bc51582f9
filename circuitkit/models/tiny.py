"""Deterministic, cached tiny fixture models built locally (no hub access, ever).

Every fixture is a directory ``cache_root()/fixtures/<name>-v<FIXTURE_VERSION>`` holding a
``save_pretrained`` model (float32 safetensors), the shared byte-level BPE tokenizer and a
``fixture_info.json``. ``ensure_fixture(name)`` returns that directory, building it first if
it is missing; concurrent builders are serialised with a file lock and the directory appears
atomically (built in a temp dir, then renamed), so a half-written fixture is never visible.

Fixtures (``FIXTURE_NAMES``):

* ``tiny-gpt2``      GPT2LMHeadModel, 2 layers, 4 heads, d_model 64, fused ``c_attn``.
* ``tiny-neox``      GPTNeoXForCausalLM, parallel residual, partial rotary (25 %).
* ``tiny-neox-seq``  GPTNeoXForCausalLM, sequential residual, partial rotary (50 %).
* ``tiny-llama``     LlamaForCausalLM, GQA (4 query heads, 2 KV heads, head_dim 16).
* ``tiny-qwen2``     Qwen2ForCausalLM, q/k/v biases, GQA, tied embeddings.
* ``tiny-gemma3``    Gemma3ForCausalLM (text), GQA, q/k norms, sliding window 8 on layer 0.
* ``tiny-gemma3-cg`` Gemma3ForConditionalGeneration with a tiny SigLIP tower; a forward with
  only ``input_ids`` runs the text path. In transformers 5.24 ``AutoModelForCausalLM`` maps
  ``model_type="gemma3"`` to ``Gemma3ForConditionalGeneration`` (so does
  ``AutoModelForImageTextToText``); both load this directory.
* ``induction``      2-layer attention-only GPT-2 trained here (~30 s on 2 CPU cores) until
  it has a verified previous-token head (L0H2) and induction head (L1H1); see ``tiny_train``.

The random models get small deterministic noise on every 1-D parameter (norm weights and
biases), so that code which ignores a norm's gain or a bias is caught by tests instead of
being hidden by an all-ones / all-zeros default.

transformers 5.24 notes: rotary settings live in ``rope_parameters`` (``rope_type``,
``rope_theta``; GPT-NeoX's fraction is ``partial_rotary_factor``, the legacy ``rotary_pct``
is only a fallback); Gemma 3's ``rope_parameters`` is keyed by layer type and its default
``layer_types`` pattern (5 sliding : 1 full) makes every layer of a 2-layer model sliding;
``Gemma3Config``'s image token ids default to ~262k, outside a small vocabulary;
``PreTrainedTokenizerFast`` is ``TokenizersBackend`` and takes ``extra_special_tokens``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

# Bump when anything that changes fixture bytes changes (corpus, tokenizer, configs, training).
FIXTURE_VERSION = 1

FIXTURE_NAMES: tuple[str, ...] = (
    "tiny-gpt2",
    "tiny-neox",
    "tiny-neox-seq",
    "tiny-llama",
    "tiny-qwen2",
    "tiny-gemma3",
    "tiny-gemma3-cg",
    "induction",
)

VOCAB_SIZE = 1024
BOS_TOKEN = EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Reserved so the multimodal Gemma 3 fixture has its image tokens inside the vocabulary, as the
# real checkpoints do; text never produces them.
IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
SPECIAL_TOKENS = (BOS_TOKEN, PAD_TOKEN, UNK_TOKEN, *ROLE_TOKENS, *IMAGE_TOKENS)

# Roles are rendered as special tokens; assistant text sits in {% generation %} so that
# apply_chat_template(..., return_assistant_tokens_mask=True) marks the supervised tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Word lists of the synthetic corpus. Names, years and small numbers become single tokens.
NAMES = tuple(
    "Mary John Alice Bob Tom James Sarah Emma David Michael Anna Lisa Paul Mark Kate Susan Peter "
    "Laura Jack Grace Daniel Rachel Steven Helen".split()
)
PLACES = tuple(
    "store park school garden office house market station library hospital restaurant beach "
    "river city village church".split()
)
OBJECTS = tuple("drink book ball apple letter ring gift key bag phone flower box ticket pen cake coin".split())
ADJECTIVES = tuple(
    "big small old new good bad long short happy sad red blue green dark bright quiet strong young".split()
)
NOUNS = tuple(
    "war king dog cat man woman child house road tree water time day year night story game friend "
    "city ship".split()
)
VERBS = tuple(
    "saw found took made gave had liked wanted helped called left kept followed watched knew moved".split()
)
EVENTS = ("war", "reign", "expedition", "trial", "festival", "drought", "strike", "journey")


def cache_root() -> Path:
    """Root of CircuitKit's local cache: ``$CIRCUITKIT_CACHE`` or ``~/.cache/circuitkit``."""
    env = os.environ.get("CIRCUITKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "circuitkit"


def fixtures_dir() -> Path:
    """Directory that holds the built fixtures (``cache_root()/fixtures``)."""
    return cache_root() / "fixtures"


def fixture_seed(name: str) -> int:
    """Seed of a fixture, derived from its name so adding fixtures never changes others."""
    return zlib.crc32(name.encode()) % (2**31)


# ----------------------------------------------------------------------------- tokenizer


def synthetic_corpus(n_sentences: int = 6000, seed: int = 0) -> list[str]:
    """English-like sentences, deterministic for a given seed.

    Covers IOI-style name templates, "from the year 17XY to the year 17ZW" statements,
    small numbers and chat-like lines, so names, years and numbers get their own tokens.
    """
    rng = random.Random(seed)
    out: list[str] = []
    for k in range(n_sentences):
        a, b = rng.sample(NAMES, 2)
        place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
        adj1, adj2 = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
        n1, n2, verb = rng.choice(NOUNS), rng.choice(NOUNS), rng.choice(VERBS)
        y1 = 1700 + (k // 8) % 100  # every year appears in every template equally often
        y2 = rng.randint(y1, 1799)
        kind = k % 8
        if kind == 0:
            out.append(f"When {a} and {b} went to the {place}, {b} gave a {obj} to {a}.")
        elif kind == 1:
            out.append(f"Then, {a} and {b} had a long talk. Afterwards {a} said to {b}: hello.")
        elif kind == 2:
            out.append(f"The {rng.choice(EVENTS)} lasted from the year {y1} to the year {y2}.")
        elif kind == 3:
            out.append(f"In {y1}, {a} {verb} the {adj1} {n1} near the {place}.")
        elif kind == 4:
            out.append(f"There were {rng.randint(0, 99)} {n1}s and {rng.randint(0, 9)} {n2}s.")
        elif kind == 5:
            out.append(f"The {adj1} {n1} {verb} the {adj2} {n2}. It was a {adj2} {n2}.")
        elif kind == 6:
            out.append(f"{a}: Can you help me with the {obj}? {b}: Yes, of course, {a}.")
        else:
            digits = " ".join(str(rng.randint(0, 9)) for _ in range(5))
            out.append(f"{a} counted {digits} and wrote {rng.randint(100, 999)} on the {obj}.")
    return out


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    # Imported lazily: only building fixtures needs the trainer.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer)
    return tok.to_str()


def build_tokenizer() -> Any:
    """Byte-level BPE tokenizer (vocab ``VOCAB_SIZE``) as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` is bos and eos, ``<pad>`` pads, ``<unk>`` is unk; no BOS is added
    automatically (GPT-2 style). Has a chat template with roles system/user/assistant.
    Deterministic: the BPE merges are learned from ``synthetic_corpus()``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS + IMAGE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


# ------------------------------------------------------------------------- random models


def _special_ids(tokenizer: Any) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _random_model(name: str, tokenizer: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Instantiate the randomly initialised model for fixture ``name`` (seeded).

    Returns the model and a dict of shape facts for ``fixture_info.json``.
    """
    import transformers as tf

    vocab = len(tokenizer)
    ids = _special_ids(tokenizer)
    common = {"vocab_size": vocab, **ids}
    torch.manual_seed(fixture_seed(name))
    if name == "tiny-gpt2":
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_inner=256, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )
        model = tf.GPT2LMHeadModel(cfg)
        facts = {"family": "gpt2", "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_model": 64}
    elif name in ("tiny-neox", "tiny-neox-seq"):
        parallel = name == "tiny-neox"
        # transformers 5 reads the rotary fraction from rope_parameters["partial_rotary_factor"]
        # (the legacy `rotary_pct` kwarg is only a fallback for old configs).
        cfg = tf.GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=256, use_parallel_residual=parallel,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25 if parallel else 0.5,
            },
            tie_word_embeddings=False, **common,
        )
        model = tf.GPTNeoXForCausalLM(cfg)
        facts = {"family": "gpt_neox", "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                 "d_model": 64, "parallel_residual": parallel,
                 "partial_rotary_factor": 0.25 if parallel else 0.5}
    elif name in ("tiny-llama", "tiny-qwen2"):
        cls_cfg, cls = (
            (tf.LlamaConfig, tf.LlamaForCausalLM) if name == "tiny-llama"
            else (tf.Qwen2Config, tf.Qwen2ForCausalLM)
        )
        cfg = cls_cfg(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=name == "tiny-qwen2", **common,
        )
        model = cls(cfg)
        facts = {"family": "llama" if name == "tiny-llama" else "qwen2", "n_layers": 2,
                 "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_model": 64}
    elif name in ("tiny-gemma3", "tiny-gemma3-cg"):
        text_cfg = tf.Gemma3TextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            max_position_embeddings=256, sliding_window=8,
            # Explicit types: the default pattern (5 sliding : 1 full) would make both of
            # our two layers sliding.
            layer_types=["sliding_attention", "full_attention"], **common,
        )
        facts = {"family": "gemma3", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                 "head_dim": 16, "d_model": 64, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"]}
        if name == "tiny-gemma3":
            model = tf.Gemma3ForCausalLM(text_cfg)
        else:
            # 32x32 image, 8x8 patches -> 4x4 patches, pooled to mm_tokens_per_image=4 (2x2).
            vision_cfg = tf.SiglipVisionConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=32, patch_size=8,
            )
            cfg = tf.Gemma3Config(
                text_config=text_cfg, vision_config=vision_cfg, mm_tokens_per_image=4,
                boi_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[0]),
                image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[1]),
                eoi_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[2]),
                **ids,
            )
            model = tf.Gemma3ForConditionalGeneration(cfg)
            facts["text_path"] = "model.language_model"
            facts["auto_class"] = "AutoModelForCausalLM or AutoModelForImageTextToText"
    else:
        raise KeyError(f"unknown random fixture {name!r}; known: {FIXTURE_NAMES}")
    with torch.no_grad():
        # Non-trivial norm gains and biases (see module docstring); same seed stream.
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn_like(p))
    model = model.float().eval()
    facts.setdefault("auto_class", "AutoModelForCausalLM")
    return model, facts


def write_fixture_info(directory: Path, info: dict[str, Any]) -> None:
    """Write ``fixture_info.json`` (sorted keys, stable bytes)."""
    (directory / "fixture_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _build_random(name: str, directory: Path) -> None:
    tokenizer = build_tokenizer()
    model, facts = _random_model(name, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    info = {
        "name": name,
        "fixture_version": FIXTURE_VERSION,
        "seed": fixture_seed(name),
        "model_class": type(model).__name__,
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "dtype": "float32",
        **facts,
    }
    write_fixture_info(directory, info)


def build_fixture(name: str, directory: Path) -> None:
    """Build fixture ``name`` into the (existing, empty) ``directory``; no caching, no lock."""
    if name == "induction":
        from circuitkit.models.tiny_train import build_induction_fixture

        build_induction_fixture(directory, build_tokenizer())
    elif name in FIXTURE_NAMES:
        _build_random(name, directory)
    else:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(FIXTURE_NAMES)}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds the same fixture
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_hf() -> Iterator[None]:
    """Hide transformers' per-file progress bars while saving fixtures; restore afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def fixture_path(name: str, out_dir: Path | None = None) -> Path:
    """Where fixture ``name`` lives: ``<out_dir or fixtures_dir()>/<name>-v<FIXTURE_VERSION>``."""
    return Path(out_dir or fixtures_dir()) / f"{name}-v{FIXTURE_VERSION}"


def ensure_fixture(name: str, out_dir: Path | None = None, force: bool = False) -> Path:
    """Return the directory of fixture ``name``, building it first if missing (or ``force``).

    The fixture is complete iff its ``fixture_info.json`` exists: that file is written last,
    inside a temp directory that is then renamed into place.
    """
    if name not in FIXTURE_NAMES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(FIXTURE_NAMES)}")
    target = fixture_path(name, out_dir)
    if not force and (target / "fixture_info.json").is_file():
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if not force and (target / "fixture_info.json").is_file():
            return target  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            with _quiet_hf():
                build_fixture(name, tmp)
            # mkdtemp makes the directory owner-only; a shared cache wants the usual umask.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
            if target.exists():
                # rename() cannot replace a non-empty directory: move the old one aside first.
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
