"""A model directory's tokenizer, loaded and checked as every request will use it."""

from __future__ import annotations

from pathlib import Path

# any of these makes a directory's tokenizer loadable (transformers' fast, slow and sentencepiece layouts)
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def require_tokenizer_files(tok_dir: Path, named: str | Path | None = None) -> None:
    """FileNotFoundError, naming `named` (default: `tok_dir`), unless `tok_dir` holds a tokenizer's files:
    transformers would otherwise make up an empty tokenizer, and every request fail with "empty prompt"."""
    if not any((tok_dir / n).is_file() for n in TOKENIZER_MARKERS):
        raise FileNotFoundError(f"{named if named is not None else tok_dir}: no tokenizer files "
                                f"({' / '.join(TOKENIZER_MARKERS)})")


def load_tokenizer(tok_dir: str | Path, vocab_size: int, named: str | Path | None = None):
    """The tokenizer of `tok_dir`: it loads, fits the model's vocabulary (`vocab_size`, config.json's), and its chat
    template, where it has one, renders a user message, else every chat request would fail. Errors name `named`
    (default: `tok_dir`), the directory the user gave."""
    from transformers import AutoTokenizer

    tok_dir = Path(tok_dir)
    name = named if named is not None else tok_dir
    require_tokenizer_files(tok_dir, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as e:  # tokenizers and transformers raise many types for a file they cannot read
        raise ValueError(f"{name}: the tokenizer does not load ({type(e).__name__}: {e})") from e
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"{name}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is {vocab_size}; "
            "it is another model's tokenizer, or the checkpoint is"
        )
    if len(tokenizer) < vocab_size / 2:  # real pairs: 99-100% (a vocabulary padded to a multiple of 64 or 128)
        raise ValueError(
            f"{name}: the tokenizer has {len(tokenizer)} tokens, under half of config.json's vocab_size "
            f"{vocab_size}; it is another model's tokenizer, or the checkpoint is"
        )
    if tokenizer.chat_template:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
        except Exception as e:  # jinja2's syntax and undefined errors, a template's own raise_exception
            raise ValueError(f"{name}: the chat template does not render a user message "
                             f"({type(e).__name__}: {e})") from e
    return tokenizer
