import hashlib
import struct
import subprocess
import sys

from storage.hashing import ModelIdentity, block_keys, hash_block, namespace_digest, root_hash

MODEL = ModelIdentity("m", "abc", "float32")
NS_HEX = "d09a4c800b928a1a11a4b0479bfca09fc2444d02c242484dec8ecc79aa96b00a"


def test_golden_namespace_and_chain():
    ns = namespace_digest(MODEL, 16, "t")
    assert ns.hex() == NS_HEX
    ks = block_keys(ns, list(range(40)), 16)
    assert [k.hash.hex() for k in ks] == [
        "6d655399691c2be36f5ae4c469425514122f47dfd6cdf5e3edee58bd2a944833",
        "1a9040016072b200eff2d13c93d3e2c8bea0ba9ea215c7f7d9dfaf9ad8c25058",
    ]
    # The chain is exactly h_i = sha256(h_{i-1} || uint32 tokens), h_-1 = sha256(namespace).
    assert ks[0].parent == root_hash(ns) == hashlib.sha256(ns).digest()
    assert ks[1].hash == hashlib.sha256(ks[0].hash + struct.pack("<16I", *range(16, 32))).digest()
    assert ks[1].token_ids == tuple(range(16, 32)) and ks[1].namespace == ns


def test_deterministic_across_processes():
    code = ("from storage.hashing import *; "
            "print(namespace_digest(ModelIdentity('m','abc','float32'),16,'t').hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout.strip()
    assert out == NS_HEX


def test_every_identity_field_changes_the_namespace():
    base = namespace_digest(MODEL, 16, "t")
    variants = [
        namespace_digest(ModelIdentity("m2", "abc", "float32"), 16, "t"),
        namespace_digest(ModelIdentity("m", "abd", "float32"), 16, "t"),
        namespace_digest(ModelIdentity("m", "abc", "bfloat16"), 16, "t"),
        namespace_digest(MODEL, 32, "t"),
        namespace_digest(MODEL, 16, "u"),
        namespace_digest(MODEL, 16, b""),
    ]
    assert len({base, *variants}) == 7


def test_only_full_blocks_and_cap():
    ns = namespace_digest(MODEL, 4, "")
    assert len(block_keys(ns, list(range(11)), 4)) == 2
    assert len(block_keys(ns, list(range(12)), 4)) == 3
    assert len(block_keys(ns, list(range(12)), 4, max_tokens=11)) == 2   # a hit is capped at len - 1


def test_continuing_a_chain_equals_hashing_from_scratch():
    ns = namespace_digest(MODEL, 4, "")
    full = block_keys(ns, list(range(16)), 4)
    tail = block_keys(ns, list(range(16)), 4, start=2, parent=full[1].hash)
    assert tail == full[2:]
    assert hash_block(full[0].hash, range(4, 8)) == full[1].hash


def test_prefix_sharing_shares_hashes():
    ns = namespace_digest(MODEL, 4, "")
    a = block_keys(ns, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys(ns, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1].hash != b[1].hash
