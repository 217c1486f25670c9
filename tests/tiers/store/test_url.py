"""Store URLs (`easykv.tiers.store.url`): the spec each URL builds (gs:// and s3:// are spec
plumbing only: built and checked by tensorstore without network), memory:// sharing, and every bad
URL, key, prefix and timeout refused by a ValueError naming the value and the fix before anything
is opened or written."""

import os

import pytest

from easykv.tiers.store.key_syntax import MAX_KEY_LENGTH, check_distinct, check_keys, check_prefix
from easykv.tiers.store.url import open_backend, parse_store_url, redact


@pytest.mark.parametrize("url, spec", [
    ("file:///srv/kv", {"driver": "file", "path": "/srv/kv/"}),
    ("file://localhost/srv/kv/", {"driver": "file", "path": "/srv/kv/"}),
    ("memory://tests", {"driver": "memory", "path": "tests/"}),
    ("gs://my-bucket/easykv/store", {"driver": "gcs", "bucket": "my-bucket", "path": "easykv/store/"}),
    ("gs://my-bucket", {"driver": "gcs", "bucket": "my-bucket", "path": ""}),
    ("s3://my-bucket/kv", {"driver": "s3", "bucket": "my-bucket", "path": "kv/"}),
    ("file+ocdbt:///srv/kv", {"driver": "ocdbt", "base": {"driver": "file", "path": "/srv/kv/"}}),
    ("gs+ocdbt://my-bucket/p", {"driver": "ocdbt", "base": {"driver": "gcs", "bucket": "my-bucket", "path": "p/"}}),
    ("S3+OCDBT://my-bucket/p", {"driver": "ocdbt", "base": {"driver": "s3", "bucket": "my-bucket", "path": "p/"}}),
])  # fmt: skip
def test_tensorstore_urls_build_their_kvstore_spec(url, spec):
    parsed = parse_store_url(url)
    assert parsed.engine == "tensorstore" and parsed.kvstore_spec == spec and parsed.redis_url is None
    assert parsed.root == ("/srv/kv" if url.lower().startswith("file") else None)


@pytest.mark.parametrize("url, client_url", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("valkey://cache.internal:6380/3", "redis://cache.internal:6380/3"),
    ("rediss://h:6379", "rediss://h:6379"),
    ("valkeys://h:6379/1", "rediss://h:6379/1"),
    ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
])  # fmt: skip
def test_redis_urls_map_to_the_clients_scheme(url, client_url):
    parsed = parse_store_url(url)
    assert parsed.engine == "redis" and parsed.redis_url == client_url and parsed.kvstore_spec is None


def test_a_password_never_reaches_messages():
    parsed = parse_store_url("redis://admin:s3cret@h:6379/0")
    assert parsed.url == "redis://admin:***@h:6379/0" and "s3cret" in parsed.redis_url
    assert redact("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    with pytest.raises(ValueError) as info:
        parse_store_url("redis://admin:s3cret@h:6379/zero")
    assert "s3cret" not in str(info.value) and "'zero'" in str(info.value)


@pytest.mark.parametrize("url, words", [
    ("file://relative/dir", ["'relative'", "file:///abs/dir"]),
    ("file://./dir", ["'.'", "absolute path"]),
    ("/abs/dir", ["no scheme", "file:///abs/dir"]),
    ("ftp://host/x", ["unknown scheme 'ftp'", "file:///abs/dir"]),
    ("file+zip:///x", ["'file+zip'", "'+ocdbt'"]),
    ("redis+ocdbt://h:1/0", ["'redis+ocdbt'", "'+ocdbt'"]),
    ("file:///srv/kv?mode=rw", ["query", "drop"]),
    ("memory://", ["memory store name ''", "memory://NAME"]),
    ("memory://a b", ["'a b'", "letters, digits"]),
    ("gs:///path", ["bucket ''", "gs://NAME/path"]),
    ("gs://Bad_Bucket!/p", ["'Bad_Bucket!'", "gs://NAME/path"]),
    ("gs://ab/p", ["spec tensorstore refuses", "bucket"]),
    ("s3://bucket/a/../b", ["'a/../b'", "'..'"]),
    ("redis://h:99999/0", ["port", "redis://127.0.0.1:6379/0"]),
    ("redis://h:port/0", ["port", "redis://127.0.0.1:6379/0"]),
    ("redis://:6379/0", ["no host", "redis://127.0.0.1:6379/0"]),
    ("redis://h:6379/zero", ["database 'zero'", "redis://host:port/0"]),
    ("unix://relative.sock", ["socket path", "unix:///path/to/redis.sock"]),
])  # fmt: skip
def test_bad_urls_are_refused_naming_the_value_and_the_fix(url, words, tmp_path):
    with pytest.raises(ValueError) as info:
        open_backend(url)
    message = str(info.value)
    assert message.startswith("store URL") and all(w in message for w in words), message


def test_a_relative_file_path_is_refused_before_any_directory_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="three slashes"):
        open_backend("file://store/dir")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_a_bad_timeout_is_refused(timeout_s, tmp_path):
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a number of seconds in \(0, 86400\)"):
        open_backend(f"file://{tmp_path}/never", timeout_s=timeout_s)
    assert not (tmp_path / "never").exists()


def test_memory_stores_of_one_name_share_data_in_a_process_and_names_are_apart():
    first, again, other = (open_backend(u) for u in ("memory://url-share", "memory://url-share", "memory://url-other"))
    assert first.put_if_absent([("k", b"v")]) == [True]
    assert again.get_many(["k"]) == [b"v"] and other.get_many(["k"]) == [None]


@pytest.mark.parametrize("key, words", [
    ("", "is empty"),
    ("/abs/key", "empty component"),
    ("a//b", "empty component"),
    ("a/b/", "empty component"),
    ("a/../b", "'..'"),
    ("a/./b", "'.' component"),
    ("..", "'..'"),
    ("a b", "' '"),
    ("clé", "'é'"),
    ("a*", "'*'"),
    ("k" * (MAX_KEY_LENGTH + 1), f"more than {MAX_KEY_LENGTH}"),
    (b"bytes", "not a str"),
    (None, "not a str"),
])  # fmt: skip
def test_bad_keys_are_refused_naming_the_key(key, words):
    with pytest.raises(ValueError) as info:
        check_keys(["good/key", key])
    message = str(info.value)
    assert message.startswith("store key 1 ") and words in message, message


def test_good_keys_and_prefixes_pass():
    check_keys(["easykv-v1/0a1b/00/" + "f" * 64 + "/3", "a", "a.b_c-d", "k" * MAX_KEY_LENGTH])
    for prefix in ("", "easykv-v1/", "easykv-v1/0a", "a/b"):
        check_prefix(prefix)


@pytest.mark.parametrize("prefix, words", [("/a", "empty component"), ("a//", "empty component"),
                                           ("a/../", "'..'"), ("a*", "'*'")])
def test_bad_prefixes_are_refused(prefix, words):
    with pytest.raises(ValueError, match="store key prefix") as info:
        check_prefix(prefix)
    assert words in str(info.value)


def test_a_single_string_is_not_taken_for_a_list_of_keys():
    with pytest.raises(TypeError, match="wrap one key in a list"):
        check_keys("abc")


def test_a_key_given_twice_is_refused():
    with pytest.raises(ValueError, match="'a' is given twice"):
        check_distinct(["a", "b", "a"])
