"""``swarmpipe tokenize``: text, JSONL or Parquet to a flat token file and its sidecar.

Tokenizing once up front makes training start instantly, lets every trainer seek anywhere (the
file is memory-mapped) and shuffle per epoch, which a stream cannot. Memory stays bounded: the
reader streams, the writer appends chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmpipe.peer.data.errors import DataError
from swarmpipe.peer.data.text_stream import TokenStream, stream_files
from swarmpipe.peer.data.token_file import TOKEN_SUFFIXES, TokenFileWriter, sidecar_path
from swarmpipe.peer.data.tokenizer import eos_token_id, load_tokenizer, tokenizer_vocab_size


def tokenize_to_file(
    data: str,
    tokenizer: str,
    out: str,
    *,
    max_tokens: int | None = None,
    overwrite: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``data`` (a .txt/.jsonl/.json/.parquet file or a folder of them) with the tokenizer
    folder ``tokenizer`` into ``out`` (``*.tokens`` or ``*.bin``) and ``out.json``; EOS after each
    document. Returns the sidecar.

    ``max_tokens`` stops after that many tokens (the cut document keeps no EOS);
    ``progress(tokens, documents)`` is called after every chunk written."""
    if not data:
        raise DataError("tokenize needs --data: a .txt/.jsonl/.json/.parquet file or a folder of them")
    target = Path(out).expanduser()
    if target.suffix not in TOKEN_SUFFIXES:
        raise DataError(f"output {target} must end in {' or '.join(TOKEN_SUFFIXES)} (training finds it by that suffix)")
    if target.is_dir():
        raise DataError(f"output {target} is a folder")
    if not overwrite and (target.exists() or sidecar_path(target).exists()):
        raise DataError(f"output {target} exists")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens must be >= 1, got {max_tokens}")
    files = stream_files(data)
    if any(f.path.resolve() == target.resolve() for f in files):
        raise DataError(f"output {target} is one of the input files")
    tok = load_tokenizer(tokenizer)
    stream = TokenStream(files, tok, eos_token_id(tok))
    writer = TokenFileWriter(target, tokenizer_vocab_size(tok), stream.eos_token_id, str(tokenizer))
    with writer:
        counted = 0
        for chunk in stream:
            if max_tokens is not None and writer.tokens + chunk.size >= max_tokens:
                chunk = chunk[: max_tokens - writer.tokens]  # the documents whose EOS made it in
                writer.write(chunk, documents=int((chunk == stream.eos_token_id).sum()))
                break
            writer.write(chunk, documents=stream.documents - counted)
            counted = stream.documents
            if progress is not None:
                progress(writer.tokens, writer.documents)
        if writer.tokens == 0:
            raise DataError(f"{data}: no text to tokenize")
        info = writer.finish()
    if progress is not None:
        progress(info.tokens, info.documents)
    return info.to_dict()
