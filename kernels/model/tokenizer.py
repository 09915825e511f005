"""A byte-level tokenizer: UTF-8 bytes are tokens 0..255, then BOS and EOS."""

from __future__ import annotations

from collections.abc import Iterable

from .config import BYTE_VOCAB_SIZE


class ByteTokenizer:
    """Token ``b`` (0..255) is the byte ``b``; ``bos_token_id`` = 256, ``eos_token_id`` = 257.

    Every string round-trips: ``decode(encode(text)) == text``.
    """

    bos_token_id: int = 256
    eos_token_id: int = 257
    vocab_size: int = BYTE_VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text`` as token ids, after BOS when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids``: ids >= 256 (BOS, EOS, and the padding ids of a model whose
        vocabulary is padded past 258) are skipped; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: on a negative id.
        """
        data = bytearray()
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative")
            if token_id < 256:
                data.append(token_id)
        return data.decode("utf-8", errors="replace")
