import pytest

from storage.config import CODECS, CacheConfig, parse_size


def test_defaults_parse():
    c = CacheConfig()
    assert (c.block_size, c.device_bytes, c.host_bytes, c.disk_bytes) == (16, 2**30, 4 * 2**30, 50 * 2**30)
    assert c.zstd_level == 3 and c.write_policy == "write_back" and c.isolate_tenants is True
    assert c.codec == "zstd" and CacheConfig(codec="raw").codec == "raw"
    assert c.disk_path.endswith("/.cache/tieredkv/kv")


@pytest.mark.parametrize("text,value", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1GB", 10**9),
                                        ("1.5KiB", 1536), (123, 123), ("0", 0), (" 2 mib ", 2 * 2**20)])
def test_sizes(text, value):
    assert parse_size(text) == value


def test_disabling_tiers():
    c = CacheConfig(host_memory=0, disk_dir=None)
    assert c.host_bytes == 0 and c.disk_path is None


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": "16"}, "block_size"),
    ({"device_memory": "lots"}, "device_memory"),
    ({"device_memory": 0}, "device_memory"),
    ({"host_memory": -1}, "host_memory"),
    ({"host_memory": "4 parsecs"}, "host_memory"),
    ({"disk_capacity": "1XB"}, "disk_capacity"),
    ({"disk_capacity": 0}, "disk_capacity"),
    ({"zstd_level": 99}, "zstd_level"),
    ({"codec": "lz4"}, "codec"),
    ({"codec": None}, "codec"),
    ({"write_policy": "write_around"}, "write_policy"),
    ({"isolate_tenants": "yes"}, "isolate_tenants"),
    ({"disk_dir": ""}, "disk_dir"),
    ({"load_deadline_margin": 0.5}, "load_deadline_margin"),
    ({"load_deadline_margin": float("nan")}, "load_deadline_margin"),
    ({"load_deadline_margin": True}, "load_deadline_margin"),
    ({"load_deadline_slack_s": -0.1}, "load_deadline_slack_s"),
    ({"load_deadline_slack_s": "1s"}, "load_deadline_slack_s"),
    ({"probe_wait_slack_s": -0.1}, "probe_wait_slack_s"),
    ({"probe_wait_slack_s": 4000}, "probe_wait_slack_s"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_the_codecs_offered_are_the_ones_the_codec_knows():
    from storage.codec.header import KINDS
    assert CODECS == (*KINDS, "auto")


def test_frozen():
    with pytest.raises(Exception):
        CacheConfig().block_size = 8


def test_the_load_deadline_slack_defaults_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TIEREDKV_LOAD_DEADLINE_SLACK_S", "2.5")
    assert CacheConfig().load_deadline_slack_s == 2.5
    assert CacheConfig(load_deadline_slack_s=0.3).load_deadline_slack_s == 0.3      # an explicit value wins
    monkeypatch.setenv("TIEREDKV_LOAD_DEADLINE_SLACK_S", "")
    assert CacheConfig().load_deadline_slack_s == 0.1
    monkeypatch.setenv("TIEREDKV_LOAD_DEADLINE_SLACK_S", "soon")
    with pytest.raises(ValueError, match="TIEREDKV_LOAD_DEADLINE_SLACK_S"):
        CacheConfig()
