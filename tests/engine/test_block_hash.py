import hashlib
import struct
import subprocess
import sys

import pytest

from engine.kv.block_hash import hash_block, prefix_block_hashes, salt_digest


def test_one_digest_per_full_block_chained():
    tokens = list(range(40))
    hashes = prefix_block_hashes(tokens, 16)
    assert len(hashes) == 2
    assert all(len(h) == 32 for h in hashes)
    first = hashlib.sha256(bytes(32) + bytes(32) + struct.pack("<16i", *range(16))).digest()
    assert hashes[0] == first
    assert hashes[1] == hashlib.sha256(bytes(32) + first + struct.pack("<16i", *range(16, 32))).digest()


def test_prefix_property_and_parent_dependence():
    a = prefix_block_hashes(list(range(64)), 16)
    b = prefix_block_hashes(list(range(48)) + [7] * 16, 16)
    assert a[:3] == b[:3] and a[3] != b[3]
    # Same block contents after a different prefix hash differently.
    c = prefix_block_hashes([9] * 16 + list(range(16, 32)), 16)
    assert c[1] != a[1]


def test_salt_separates_tenants():
    tokens = list(range(32))
    assert prefix_block_hashes(tokens, 16, "tenant-a") != prefix_block_hashes(tokens, 16, "tenant-b")
    assert prefix_block_hashes(tokens, 16, "tenant-a") == prefix_block_hashes(tokens, 16, "tenant-a")
    assert prefix_block_hashes(tokens, 16, None) != prefix_block_hashes(tokens, 16, "")
    assert salt_digest(None) == bytes(32)


def test_identical_in_another_process():
    code = (
        "from engine.kv.block_hash import prefix_block_hashes as p\n"
        "print(p(list(range(50)), 16, 's')[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == prefix_block_hashes(list(range(50)), 16, "s")[-1].hex()


def test_invalid_input():
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="token ids"):
        prefix_block_hashes([-1] * 16, 16)
    with pytest.raises(ValueError, match="token ids"):
        prefix_block_hashes([2**31] * 16, 16)
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"short", [1] * 16)
