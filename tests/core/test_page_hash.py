import os
import subprocess
import sys

import pytest

from esurge.core.page_hash import hash_page, hash_pages, token_bytes


def test_page_hash_is_128_bits_and_deterministic():
    assert len(hash_page(None, [1, 2, 3, 4])) == 16
    assert hash_page(None, [1, 2, 3, 4]) == hash_page(None, [1, 2, 3, 4])


def test_hash_pages_chains_pages_and_ignores_the_partial_tail():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    first = hash_page(None, tokens[:4], ("salt",))
    second = hash_page(first, tokens[4:8])
    assert hash_pages(None, tokens, 4, ("salt",)) == [first, second]
    # Continuing from a parent gives the same chain as hashing in one go.
    assert hash_pages(first, tokens[4:], 4) == [second]


@pytest.mark.parametrize(
    "other",
    [
        (None, [1, 2, 4, 3], ()),  # token order
        (b"\x01" * 16, [1, 2, 3, 4], ()),  # parent
        (None, [1, 2, 3, 4], ("a",)),  # salt
        (None, [1, 2, 3, 4], ("",)),  # empty salt is still a salt
        (None, [1, 2, 3, 4], (b"a",)),  # bytes vs str key
        (None, [1, 2, 3], ()),  # length
    ],
)
def test_any_input_change_changes_the_hash(other):
    parent, tokens, extra = other
    assert hash_page(parent, tokens, extra) != hash_page(None, [1, 2, 3, 4])


def test_token_encoding_is_canonical_little_endian_u64():
    assert token_bytes([1, 256]) == (1).to_bytes(8, "little") + (256).to_bytes(8, "little")


def test_bad_tokens_and_keys_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        token_bytes([1, -1])
    with pytest.raises(ValueError, match="extra keys"):
        hash_page(None, [1], (True,))
    with pytest.raises(ValueError, match="page_size"):
        hash_pages(None, [1, 2], 0)


def test_hash_is_the_same_in_other_processes_whatever_their_hash_seed():
    code = ("from esurge.core.page_hash import hash_pages;"
            "print(b''.join(hash_pages(None, list(range(32)), 16, ('tenant',))).hex())")
    here = b"".join(hash_pages(None, list(range(32)), 16, ("tenant",))).hex()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == here
