"""Content hashes of full KV pages: the keys of the prefix cache.

A page's hash chains its parent's hash, its token ids and optional extra keys
(a request's cache salt rides on the first page, so every later page differs
too). The digest is xxh3-128 over a canonical byte encoding (little-endian
64-bit token ids, length- and type-tagged extra keys), so it is the same in
every process and run, unlike Python's salted `hash()`.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["ExtraKey", "PageHash", "hash_page", "hash_pages", "token_bytes"]

PageHash = bytes
ExtraKey = str | int | bytes

_digest = xxhash.xxh3_128_digest
# Hash of the (absent) parent of a sequence's first page; versioned so a
# change of encoding never matches hashes from an older one.
_ROOT: PageHash = _digest(b"esurge.kv-page-hash.v1")
_COUNT = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical encoding of token ids: little-endian unsigned 64-bit each."""
    try:
        packed = array("Q", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(
            f"token ids must be ints in [0, 2**64), got {list(token_ids)[:8]!r}..."
        ) from exc
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _encode_extra(extra_keys: tuple[ExtraKey, ...]) -> bytes:
    parts: list[bytes] = [_COUNT.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, str | int | bytes):
            raise ValueError(f"extra keys must be str, int or bytes, got {key!r}")
        if isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        elif isinstance(key, int):
            tag, raw = b"i", str(key).encode("ascii")
        else:
            tag, raw = b"b", key
        parts.append(tag + _COUNT.pack(len(raw)) + raw)
    return b"".join(parts)


_NO_EXTRA = _encode_extra(())


def hash_page(
    parent: PageHash | None, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
) -> PageHash:
    """Hash of one page given its parent's hash (None for a sequence's first page)."""
    return _digest(
        (parent or _ROOT) + _COUNT.pack(len(token_ids)) + token_bytes(token_ids)
        + _encode_extra(extra_keys)
    )


def hash_pages(
    parent: PageHash | None,
    token_ids: Sequence[int],
    page_size: int,
    first_extra_keys: tuple[ExtraKey, ...] = (),
) -> list[PageHash]:
    """Chained hashes of the consecutive full pages of token_ids.

    A trailing partial page is ignored. first_extra_keys apply to the first page
    hashed here only (callers pass them when that page is a sequence's first).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size!r}")
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    raw = token_bytes(token_ids[: num_pages * page_size])
    stride = 8 * page_size
    header = _COUNT.pack(page_size)
    extra = _encode_extra(first_extra_keys) if first_extra_keys else _NO_EXTRA
    tail = _NO_EXTRA
    hashes: list[PageHash] = []
    prev = parent or _ROOT
    for i in range(num_pages):
        prev = _digest(prev + header + raw[i * stride:(i + 1) * stride] + (tail if i else extra))
        hashes.append(prev)
    return hashes
