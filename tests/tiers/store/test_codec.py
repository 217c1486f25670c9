"""The store value codec: round trips of every stored dtype, and every kind of damage refused with
its reason before any byte reaches a page."""

import math
import pickle
import struct
import time

import ml_dtypes
import numpy as np
import pytest
from isal import isal_zlib

from easykv.tiers.store import codec
from easykv.tiers.store.codec import StoreValueError, decode, decode_into, encode, raw_bits

KEY = "easykv-v1/m-0123456789abcdef/00112233445566778899aabbccddeeff/" + "ab" * 32 + "/0"
OTHER_KEY = KEY[:-1] + "1"


def leaves_of_every_dtype(seed=0):
    """A page's leaves as a quantized and a plain cache store them: bf16 bits, int8 codes, float32
    scales, packed uint8 nibbles, uint32 words."""
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((3, 1, 4, 8)).astype(ml_dtypes.bfloat16),
        rng.integers(0, 2**16, (3, 1, 4, 8), dtype=np.uint16),
        rng.integers(-128, 128, (3, 1, 4, 8), dtype=np.int8),
        rng.standard_normal((3, 1, 4)).astype(np.float32),
        rng.integers(0, 256, (3, 1, 4, 4), dtype=np.uint8),
        rng.integers(0, 2**32, (2, 5), dtype=np.uint32),
    ]


def expected_of(leaves):
    return [(a.shape, a.dtype) for a in leaves]


def header_regions(value, leaves):
    """(start, stop, reason) of each field of ``value``'s header, the payload and the checksum:
    the reason a flipped byte there is refused with."""
    klen = struct.unpack_from("<H", value, 6)[0]
    regions = [(0, 4, "magic"), (4, 6, "version"), (6, 8 + klen, "key")]
    pos = 8 + klen
    leaf_headers = pos
    pos += 2
    for a in leaves:
        pos += 1 + len(raw_bits(a).dtype.str) + 4 + 4 * a.ndim
    regions.append((leaf_headers, pos, "shape"))
    regions.append((pos, len(value), "checksum"))  # the payload and the CRC itself
    return regions


# --------------------------------------------------------------------------------- round trips
def test_round_trip_of_every_stored_dtype_is_bit_exact():
    leaves = leaves_of_every_dtype()
    value = encode(KEY, leaves)
    out = decode(KEY, value, expected_of(leaves))
    assert len(out) == len(leaves)
    for a, b in zip(leaves, out):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(raw_bits(b), raw_bits(a))
        assert not b.flags.writeable  # read-only views into the value, as documented


def test_layout_is_the_documented_one():
    a = np.array([[1, 2, 3]], np.uint16)
    value = encode("k/1", [a])
    body = (b"EKVS" + struct.pack("<H", 1) + struct.pack("<H", 3) + b"k/1" + struct.pack("<H", 1)
            + bytes([3]) + b"<u2" + struct.pack("<I", 2) + struct.pack("<2I", 1, 3) + a.tobytes())
    assert value == body + struct.pack("<I", isal_zlib.crc32(body))


def test_cpu_raw_bits_writer_and_bfloat16_reader_agree():
    bf = np.random.default_rng(1).standard_normal((2, 4)).astype(ml_dtypes.bfloat16)
    as_cpu_stores_it = bf.view(np.uint16)
    value = encode(KEY, [as_cpu_stores_it])
    assert value == encode(KEY, [bf])  # same bytes whichever side wrote it
    (back,) = decode(KEY, value, [((2, 4), np.dtype(ml_dtypes.bfloat16))])
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), as_cpu_stores_it)


def test_non_contiguous_and_zero_dim_leaves_round_trip():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    leaves = [base[:, ::2], np.array(7, np.int8), np.zeros((0, 3), np.uint16)]
    out = decode(KEY, encode(KEY, leaves), expected_of(leaves))
    for a, b in zip(leaves, out):
        np.testing.assert_array_equal(a, b)


def test_decode_into_fills_the_given_arrays_as_raw_bits():
    leaves = leaves_of_every_dtype()
    value = encode(KEY, leaves)
    # The host pages of a CPU cache hold bf16 as uint16: a reader passes those.
    outs = [np.zeros(a.shape, codec.raw_dtype(a.dtype)) for a in leaves]
    decode_into(KEY, value, outs)
    for a, o in zip(leaves, outs):
        np.testing.assert_array_equal(o, raw_bits(a))
    strided = np.zeros((3, 1, 4, 16), np.uint16)[..., ::2]  # a page slice need not be contiguous
    decode_into(KEY, encode(KEY, [leaves[1]]), [strided])
    np.testing.assert_array_equal(strided, leaves[1])


def test_decode_into_leaves_the_outputs_unchanged_on_refusal():
    leaves = leaves_of_every_dtype()
    value = bytearray(encode(KEY, leaves))
    value[-10] ^= 0x01  # payload damage: found only by the checksum, after the header passed
    outs = [np.full(a.shape, 7, codec.raw_dtype(a.dtype)) for a in leaves]
    with pytest.raises(StoreValueError) as err:
        decode_into(KEY, bytes(value), outs)
    assert err.value.reason == "checksum"
    assert all((o == 7).all() for o in outs)


def test_decode_into_refuses_read_only_and_non_array_outputs():
    a = np.zeros((2, 2), np.uint16)
    value = encode(KEY, [a])
    ro = np.zeros((2, 2), np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"outs\[0\] is read-only; pass the writable"):
        decode_into(KEY, value, [ro])
    with pytest.raises(TypeError, match="must be a numpy array, got list"):
        decode_into(KEY, value, [[0, 0]])


# --------------------------------------------------------------------------------- damage
def refused(value, reason, key=KEY, expected=None):
    expected = expected_of(leaves_of_every_dtype()) if expected is None else expected
    with pytest.raises(StoreValueError) as err:
        decode(key, bytes(value), expected)
    assert err.value.reason == reason, (err.value.reason, str(err.value))
    assert err.value.key == key and key in str(err.value) and "treated as a miss" in str(err.value)
    assert isinstance(err.value, ValueError)
    return err.value


def test_every_flipped_byte_is_refused_with_its_fields_reason():
    leaves = leaves_of_every_dtype()
    value = encode(KEY, leaves)
    regions = header_regions(value, leaves)
    positions = sorted({*range(0, 8 + len(KEY) + 40), *range(0, len(value), 7), *range(len(value) - 8, len(value))})
    for pos in positions:
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(value)
            damaged[pos] ^= flip
            reason = next(r for start, stop, r in regions if start <= pos < stop)
            assert refused(damaged, reason).reason


def test_every_truncation_is_refused():
    value = encode(KEY, leaves_of_every_dtype())
    for n in sorted({*range(0, 120), *range(120, len(value), 13), len(value) - 1}):
        err = refused(value[:n], "truncated")
        assert "cut short" in str(err) or "end inside" in str(err)


def test_extra_bytes_are_refused():
    value = encode(KEY, leaves_of_every_dtype())
    assert refused(value + b"\x00", "truncated").reason
    # Extended with a checksum made to match: the length alone gives it away.
    body = value[:-4] + b"junk"
    assert refused(body + struct.pack("<I", isal_zlib.crc32(body)), "truncated").reason


def test_the_value_of_another_key_is_refused():
    leaves = leaves_of_every_dtype()
    err = refused(encode(OTHER_KEY, leaves), "key")
    assert OTHER_KEY in str(err)
    refused(encode(KEY + "0", leaves), "key")  # a longer key of the same prefix


def test_another_format_version_is_refused(monkeypatch):
    leaves = leaves_of_every_dtype()
    monkeypatch.setattr(codec, "FORMAT_VERSION", 2)
    newer = encode(KEY, leaves)
    monkeypatch.undo()
    err = refused(newer, "version")
    assert "layout version 2, this easykv reads 1" in str(err)


def test_leaf_count_dtype_and_shape_mismatches_are_refused():
    leaves = leaves_of_every_dtype()
    value = encode(KEY, leaves)
    want = expected_of(leaves)
    assert refused(value, "shape", expected=want[:-1]).reason
    assert refused(value, "shape", expected=[*want, ((1,), np.dtype(np.uint8))]).reason
    refused(value, "shape", expected=[((3, 1, 4, 8), np.dtype(np.uint32)), *want[1:]])  # other item size
    assert refused(value, "shape", expected=[((3, 1, 8, 4), want[0][1]), *want[1:]]).reason
    assert refused(value, "shape", expected=[((3, 1, 4, 8, 1), want[0][1]), *want[1:]]).reason


def test_same_size_dtypes_share_raw_bits():
    # int8 codes and uint8 nibbles are both one raw byte: the stored format (the namespace), not
    # the codec, tells them apart.
    a = np.arange(4, dtype=np.int8)
    (b,) = decode(KEY, encode(KEY, [a]), [((4,), np.dtype(np.uint8))])
    assert b.dtype == np.uint8 and (b == np.arange(4)).all()


def test_a_header_claiming_a_huge_shape_allocates_nothing():
    leaves = [np.zeros((2, 3), np.uint16)]
    value = bytearray(encode(KEY, leaves))
    shape_at = 8 + len(KEY) + 2 + 1 + 3 + 4
    struct.pack_into("<2I", value, shape_at, 2**32 - 1, 2**32 - 1)
    assert refused(value, "shape", expected=expected_of(leaves)).reason
    # Even when the caller expects the huge shape, the length check refuses before any read.
    huge = [((2**32 - 1, 2**32 - 1), np.dtype(np.uint16))]
    body = bytes(value[:-4])
    assert refused(body + struct.pack("<I", isal_zlib.crc32(body)), "truncated", expected=huge).reason
    # A huge key length or leaf count is bounded by the value's own length.
    struct.pack_into("<H", value, 6, 65535)
    assert refused(value, "key", expected=expected_of(leaves)).reason


def test_a_pickle_is_refused_and_never_loaded():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("a store value was unpickled",))

    for blob in (pickle.dumps(Boom()), pickle.dumps(np.zeros(4)), pickle.dumps({"EKVS": 1})):
        assert refused(blob, "magic").reason


def test_random_bytes_and_foreign_values_are_refused():
    rng = np.random.default_rng(0)
    for n in (1, 3, 4, 16, 1000):
        with pytest.raises(StoreValueError) as err:
            decode(KEY, rng.integers(0, 256, n, dtype=np.uint8).tobytes(), expected_of(leaves_of_every_dtype()))
        assert err.value.reason in ("magic", "truncated")


# --------------------------------------------------------------------------------- bad arguments
def test_bad_arguments_are_caller_errors_not_damage():
    leaves = [np.zeros(2, np.uint16)]
    value = encode(KEY, leaves)
    cases = [
        (lambda: encode(b"k", leaves), TypeError, "store key must be a str, got bytes"),
        (lambda: encode("", leaves), ValueError, "non-empty ASCII"),
        (lambda: encode("kéy", leaves), ValueError, "non-empty ASCII"),
        (lambda: encode(KEY, [[1, 2]]), TypeError, "must be a numpy array, got list"),
        (lambda: encode(KEY, [np.zeros(2, complex)]), ValueError, "cannot be stored as raw bits"),
        (lambda: encode(KEY, [np.array(["a"])]), ValueError, "cannot be stored as raw bits"),
        (lambda: encode(KEY, [np.zeros(2, ">u2")]), ValueError, r"big-endian.*astype\('<u2'\)"),
        (lambda: decode(KEY, "text", [((2,), np.dtype(np.uint16))]), TypeError, "must be bytes, got str"),
        (lambda: decode(KEY, value, [((2,), np.uint16, 1)]), TypeError, r"expected\[0\] must be a \(shape, dtype\)"),
        (lambda: decode(KEY, value, [([2], np.uint16)]), ValueError, r"expected\[0\]'s shape must be a tuple"),
        (lambda: decode(KEY, value, [((-1,), np.uint16)]), ValueError, r"expected\[0\]'s shape must be a tuple"),
        (lambda: decode(KEY, value, "x"), TypeError, "sequence of \\(shape, dtype\\) pairs"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message) as err:
            call()
        assert not isinstance(err.value, StoreValueError)


def test_raw_bits_views_without_a_copy():
    a = np.zeros((2, 3), ml_dtypes.bfloat16)
    r = raw_bits(a)
    assert r.dtype == np.uint16 and np.shares_memory(a, r)
    assert raw_bits(np.zeros(2, np.float32)).dtype == np.uint32
    assert raw_bits(np.zeros(2, ml_dtypes.float8_e4m3fn)).dtype == np.uint8
    assert raw_bits(np.zeros(2, np.int64)).dtype == np.dtype("<u8")


# --------------------------------------------------------------------------------- speed
def _best(fn, repeat=30):
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_codec_speed_against_a_plain_copy(capsys):
    """28 layers x 1 head x page 16 x dim 128, bf16 K and V (~230 KiB): encode and decode beside the
    floor, a plain ``bytes(a)`` / ``np.frombuffer`` copy of the same bytes. Reported, and bounded
    loosely (a shared CI core is noisy): encode within 4x the floor's time."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((28, 1, 16, 128)).astype(ml_dtypes.bfloat16) for _ in range(2))
    value = encode(KEY, [k, v])
    want = [(k.shape, k.dtype), (v.shape, v.dtype)]
    outs = [np.empty(k.shape, np.uint16), np.empty(v.shape, np.uint16)]
    mb = (k.nbytes + v.nbytes) / 1e6
    floor_out = [np.empty_like(outs[0]), np.empty_like(outs[1])]
    times = {
        "floor encode: bytes(k) + bytes(v)": _best(lambda: (bytes(k.view(np.uint16)), bytes(v.view(np.uint16)))),
        "encode": _best(lambda: encode(KEY, [k, v])),
        "floor decode: np.frombuffer copy": _best(lambda: [np.copyto(o, np.frombuffer(value, np.uint16, o.size)
                                                                     .reshape(o.shape)) for o in floor_out]),
        "decode (views)": _best(lambda: decode(KEY, value, want)),
        "decode_into": _best(lambda: decode_into(KEY, value, outs)),
    }
    with capsys.disabled():
        print(f"\ncodec on {len(value)} bytes:")
        for name, t in times.items():
            print(f"  {name:38s} {t * 1e6:8.1f} us  {mb / t:8.0f} MB/s")
    assert times["encode"] < 4 * times["floor encode: bytes(k) + bytes(v)"] + 200e-6
