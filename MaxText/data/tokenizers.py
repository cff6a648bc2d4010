"""Tokenizers from local files: sentencepiece, tiktoken, Hugging Face `tokenizers`.

  sentencepiece  a .model file (SentencePieceProcessor); BOS/EOS as the model defines them
  tiktoken       a BPE ranks file (one `base64-token rank` a line, as tiktoken and Llama 3
                 ship them), split with the Llama 3 pattern; <|begin_of_text|> and
                 <|end_of_text|> are appended after the ranks as BOS and EOS
  huggingface    a tokenizer.json (or a directory holding one); BOS/EOS from a
                 tokenizer_config.json beside it, else the usual special-token names

Each exposes encode(text) -> list of ids (no special tokens), bos_id / eos_id (None
when the tokenizer has none) and vocab_size. A file that is missing or unreadable is
a one-line UserError.
"""

import base64
import json
from pathlib import Path

from MaxText.errors import UserError

# Llama 3's pre-tokenizer pattern, used for tiktoken rank files.
TIKTOKEN_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>")
HF_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
HF_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]")


class SentencePiece:
  def __init__(self, path: Path):
    import sentencepiece as spm

    self.sp = spm.SentencePieceProcessor(model_file=str(path))
    self.vocab_size = self.sp.get_piece_size()
    self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
    self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)


class TikToken:
  def __init__(self, path: Path):
    import tiktoken

    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
      if not line.strip():
        continue
      token, rank = line.split()
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    if not ranks:
      raise ValueError("no ranks")
    special = {name: len(ranks) + i for i, name in enumerate(TIKTOKEN_SPECIAL)}
    self.enc = tiktoken.Encoding(
      name=path.name, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )
    self.vocab_size = self.enc.n_vocab
    self.bos_id, self.eos_id = special[TIKTOKEN_SPECIAL[0]], special[TIKTOKEN_SPECIAL[1]]

  def encode(self, text: str) -> list[int]:
    return self.enc.encode_ordinary(text)


class HuggingFace:
  def __init__(self, path: Path):
    from tokenizers import Tokenizer

    if path.is_dir():
      path = path / "tokenizer.json"
    self.tok = Tokenizer.from_file(str(path))
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    named = self._named_specials(path.parent / "tokenizer_config.json")
    self.bos_id = self._find(named.get("bos_token"), HF_BOS_NAMES)
    self.eos_id = self._find(named.get("eos_token"), HF_EOS_NAMES)

  @staticmethod
  def _named_specials(config: Path) -> dict:
    if not config.is_file():
      return {}
    out = {}
    for key, value in json.loads(config.read_text()).items():
      if key in ("bos_token", "eos_token") and value:
        out[key] = value["content"] if isinstance(value, dict) else value
    return out

  def _find(self, name: str | None, fallbacks: tuple[str, ...]) -> int | None:
    for candidate in (name,) if name else fallbacks:
      token_id = self.tok.token_to_id(candidate)
      if token_id is not None:
        return token_id
    return None

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, add_special_tokens=False).ids


TOKENIZERS = {"sentencepiece": SentencePiece, "tiktoken": TikToken, "huggingface": HuggingFace}


def load_tokenizer(kind: str, path: str, what: str = "tokenizer_path"):
  """The tokenizer of type `kind` (a TOKENIZERS key) from `path`; UserError if it cannot be read.

  `what` names the setting that gave the path in the message (a config key, or a command-line flag).
  """
  p = Path(path).expanduser()
  if not p.exists():
    raise UserError(f"{what} {path} does not exist")
  try:
    return TOKENIZERS[kind](p)
  except Exception as e:  # noqa: BLE001 - each library reports a bad file its own way
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"{what} {path} is not a readable {kind} tokenizer: {detail}") from None


class DocumentEncoder:
  """A document's text -> its token ids as training sees them: BOS + tokenizer ids + EOS, each if asked for.

  The one definition both tokenize-as-you-train (pipeline.Tokenize) and pre-tokenization (pretokenize.py) use,
  so that a pre-tokenized corpus feeds exactly the ids on-the-fly tokenization would.
  `switch_off(name)` says how to turn a missing BOS/EOS off in the caller's terms (a config key, a flag).
  """

  def __init__(self, tok, path: str, add_bos: bool, add_eos: bool, switch_off):
    for flag, token_id, name in ((add_bos, tok.bos_id, "BOS"), (add_eos, tok.eos_id, "EOS")):
      if flag and token_id is None:
        raise UserError(f"tokenizer {path} has no {name} token; {switch_off(name.lower())}")
    self.tok = tok
    self.prefix = [tok.bos_id] if add_bos else []
    self.suffix = [tok.eos_id] if add_eos else []

  def ids(self, document) -> list[int]:
    text = document.decode("utf-8") if isinstance(document, bytes) else str(document)
    return self.prefix + self.tok.encode(text) + self.suffix
