"""How many tokens the pipeline's tokenizer makes of a prompt, counted on the server without torch.

A character limit alone lets through prompts the model cannot take: 4000 emoji are 4000 characters
but about 8000 tokens, and the transformer's rotary table has 4096 positions for the text *and* the
image grid together (diffusers `QwenEmbedRope`), so such an edit failed inside the pipeline. The
pipelines say 1024 tokens (`tokenizer_max_length`); we refuse above that, up front, with the count.

The checkpoint's tokenizer is read with the `tokenizers` library (Rust, no torch): `tokenizer.json`
where the folder has one, else Qwen2's byte-level BPE rebuilt from `vocab.json` + `merges.txt` the
way transformers' `Qwen2Tokenizer` builds it (same pre-tokenizer regex, NFC, no prefix space). If no
tokenizer can be read, the count falls back to the prompt's UTF-8 bytes: a byte-level BPE never makes
more tokens than bytes, so the bound still holds (and only over-counts).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1024  # the pipelines' tokenizer_max_length
# transformers models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class PromptTokens:
    """count(text) -> tokens, as the checkpoint's tokenizer makes them (or UTF-8 bytes, an upper bound)."""

    def __init__(self, tokenizer=None, source: str = "utf-8 bytes (upper bound)"):
        self._tokenizer = tokenizer
        self.source = source

    def count(self, text: str) -> int:
        if self._tokenizer is None:
            return len(text.encode("utf-8"))
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> PromptTokens:
        folder = Path(folder) / "tokenizer"
        if not folder.is_dir():  # Qwen-Image-2.1: the processor holds the tokenizer
            folder = folder.with_name("processor")
        files = "tokenizer.json" if (folder / "tokenizer.json").is_file() else "vocab.json + merges.txt"
        try:
            return cls(_read(folder), f"the checkpoint's tokenizer ({files})")
        except Exception as exc:  # noqa: BLE001 - any unreadable tokenizer: fall back to the byte bound
            log.warning("cannot read the tokenizer in %s (%s: %s); prompts are bounded by their UTF-8 bytes",
                        folder, type(exc).__name__, str(exc)[:200])
            return cls()


def _read(folder: Path):
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#version")]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False,
                              byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    config = folder / "tokenizer_config.json"
    added = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
    tokenizer.add_special_tokens([AddedToken(t["content"], special=True, normalized=False)
                                  for t in added.values()])
    return tokenizer
