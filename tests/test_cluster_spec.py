"""Cluster files: the examples parse to the right devices and rates, and every mistake is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fusionllm.cluster import (
    DEVICE_PRESETS,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    SiteSpec,
    format_rate,
    load_cluster,
    parse_cluster,
    parse_flops,
    parse_latency,
    parse_memory,
    parse_rate,
)
from fusionllm.core.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
M = 10**6
G = 10**9
GiB = 2**30

TWO_SITES = """
[sites.A]
devices = 2
cpus = 0.5
bandwidth = "1gbit"
[sites.B]
devices = 1
cpus = 0.25
bandwidth = "1gbit"
[[links]]
sites = ["A", "B"]
bandwidth = "20mbit"
"""


def _site(name: str = "A", **keys: str) -> str:
    body = {"devices": "1", "cpus": "0.5", "bandwidth": '"1gbit"', **keys}
    lines = [f"{k} = {v}" for k, v in body.items() if v is not None]
    return f"[sites.{name}]\n" + "\n".join(lines) + "\n"


def _link(a: str, b: str, **keys: str) -> str:
    body = {"sites": f'["{a}", "{b}"]', "bandwidth": '"20mbit"', **keys}
    lines = [f"{k} = {v}" for k, v in body.items() if v is not None]
    return "[[links]]\n" + "\n".join(lines) + "\n"


def _fails(text: str, *fragments: str) -> str:
    """Parse `text` as test.toml, expect a one-line ConfigError holding every fragment."""
    with pytest.raises(ConfigError, match=re.escape(fragments[0])) as info:
        parse_cluster(text, source="test.toml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("test.toml: ")
    for fragment in fragments[1:]:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# --- the examples ----------------------------------------------------------------------


def test_three_sites_example() -> None:
    c = load_cluster(EXAMPLES / "three-sites.toml")
    assert c.name == "three-sites"
    assert list(c.sites) == ["A", "B", "C"]
    assert c.num_devices == 4
    assert [d.site for d in c.devices()] == ["A", "A", "B", "C"]
    assert [d.index for d in c.devices()] == [0, 1, 2, 3]
    assert [d.cpus for d in c.devices()] == [0.5, 0.5, 0.6, 0.4]
    assert c.total_cpus == pytest.approx(2.0)
    m = c.bandwidth_matrix()
    assert m == [
        [0, 1 * G, 50 * M, 8 * M],
        [1 * G, 0, 50 * M, 8 * M],
        [50 * M, 50 * M, 0, 200 * M],
        [8 * M, 8 * M, 200 * M, 0],
    ]
    assert all(m[i][j] == m[j][i] for i in range(4) for j in range(4))
    rates = {link.bandwidth_bps for link in c.links.values()}
    assert min(rates) == 8 * M and max(rates) == 200 * M
    assert c.latency_ms(0, 3) == 0.0  # the testbed cannot emulate latency, so the example has none


def test_uniform_example() -> None:
    c = load_cluster(EXAMPLES / "uniform.toml")
    assert c.num_devices == 4 and len(c.sites) == 1 and c.links == {}
    assert c.total_cpus == pytest.approx(2.0)
    assert all(d.cpus == 0.5 for d in c.devices())
    m = c.bandwidth_matrix()
    assert m == [[0 if i == j else G for j in range(4)] for i in range(4)]


def test_probe_rates_example() -> None:
    c = load_cluster(EXAMPLES / "probe-rates.toml")
    assert [d.site for d in c.devices()] == ["P", "Q", "R"]
    assert c.bandwidth(0, 1) == 8 * M
    assert c.bandwidth(0, 2) == 50 * M
    assert c.bandwidth(2, 1) == 200 * M
    m = c.bandwidth_matrix()
    assert all(m[i][j] == m[j][i] for i in range(3) for j in range(3))
    assert sorted({m[i][j] for i in range(3) for j in range(3) if i != j}) == [
        8 * M,
        50 * M,
        200 * M,
    ]


def test_two_sites_from_string() -> None:
    c = parse_cluster(TWO_SITES)
    assert c.name == "cluster"
    assert c.num_devices == 3
    assert c.bandwidth(0, 1) == G
    assert c.bandwidth(1, 2) == c.bandwidth(2, 1) == 20 * M
    assert c.devices()[2] == DeviceSpec(2, "B", 0.25, None, None)
    assert c.total_cpus == pytest.approx(1.25)
    assert c.links[frozenset({"A", "B"})] == LinkSpec("A", "B", 20 * M)
    assert c.sites["B"] == SiteSpec("B", 1, 0.25, G)


def test_name_defaults_to_file_stem_and_top_level_name_wins(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(TWO_SITES)
    assert load_cluster(path).name == "mine"
    path.write_text('name = "lab"\n' + TWO_SITES)
    assert load_cluster(str(path)).name == "lab"


def test_to_dict_is_json_and_complete() -> None:
    c = load_cluster(EXAMPLES / "three-sites.toml")
    d = json.loads(json.dumps(c.to_dict()))
    assert d["num_devices"] == 4
    assert d["sites"]["B"]["cpus"] == 0.6
    assert d["sites"]["A"]["bandwidth"] == "1gbit"
    assert {(tuple(link["sites"]), link["bandwidth"]) for link in d["links"]} == {
        (("A", "B"), "50mbit"),
        (("A", "C"), "8mbit"),
        (("B", "C"), "200mbit"),
    }


def test_spec_is_frozen() -> None:
    c = parse_cluster(TWO_SITES)
    with pytest.raises(AttributeError):
        c.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        c.sites["A"].cpus = 1.0  # type: ignore[misc]


def test_bandwidth_needs_two_valid_devices() -> None:
    c = parse_cluster(TWO_SITES)
    with pytest.raises(ConfigError, match=r"device 1: .*i == j"):
        c.bandwidth(1, 1)
    with pytest.raises(
        ConfigError, match=r"device 3: no such device; cluster cluster has devices 0\.\.2"
    ):
        c.bandwidth(0, 3)
    with pytest.raises(ConfigError, match=r"device -1"):
        c.bandwidth(-1, 0)


def test_cluster_spec_validates_at_construction() -> None:
    a, b = SiteSpec("A", 1, 0.5, G), SiteSpec("B", 1, 0.5, G)
    with pytest.raises(ConfigError, match="no \\[\\[links\\]\\] entry between sites A and B"):
        ClusterSpec({"A": a, "B": b}, {}, "x")
    with pytest.raises(ConfigError, match="sites.A.cpus: must be > 0"):
        SiteSpec("A", 1, 0.0, G)
    with pytest.raises(ConfigError, match="link A-A"):
        LinkSpec("A", "A", G)


# --- rates and other quantities --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1bit", 1),
        ("1kbit", 1000),
        ("20mbit", 20 * M),
        ("20 mbit", 20 * M),
        ("  8Mbit ", 8 * M),
        ("1GBIT", G),
        ("1.5gbit", 1_500_000_000),
        ("0.5kbit", 500),
        (".25mbit", 250_000),
    ],
)
def test_parse_rate(text: str, bps: int) -> None:
    assert parse_rate(text) == bps
    assert isinstance(parse_rate(text), int)


@pytest.mark.parametrize(
    ("bps", "text"),
    [
        (20 * M, "20mbit"),
        (G, "1gbit"),
        (8 * M, "8mbit"),
        (1_500_000_000, "1.5gbit"),
        (999, "999bit"),
        (1000, "1kbit"),
        (1_234_567, "1.234567mbit"),
        (200 * M, "200mbit"),
        (10 * G, "10gbit"),
    ],
)
def test_format_rate_round_trips(bps: int, text: str) -> None:
    assert format_rate(bps) == text
    assert parse_rate(format_rate(bps)) == bps


def test_format_rate_round_trips_many() -> None:
    for bps in [1, 7, 10, 12_345, 100_001, 8 * M + 1, 3 * G + 7, 12 * G]:
        assert parse_rate(format_rate(bps)) == bps


@pytest.mark.parametrize(
    "bad",
    [
        "20",
        "20mbps",
        "20Mbps",
        "-5mbit",
        "0mbit",
        "0bit",
        "abc",
        "",
        "mbit",
        "1.5bit",
        "5 m bit",
        "1e6bit",
    ],
)
def test_parse_rate_rejects(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^links\[3\]\.bandwidth: "):
        parse_rate(bad, "links[3].bandwidth")


def test_parse_rate_rejects_numbers_and_names_default_key() -> None:
    with pytest.raises(ConfigError, match=r"^bandwidth: .*quoted string"):
        parse_rate(1000)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="megabytes"):
        parse_rate("8mbps")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_format_rate_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        format_rate(bad)  # type: ignore[arg-type]


def test_other_quantities() -> None:
    assert parse_latency("5ms") == 5.0
    assert parse_latency("250us") == pytest.approx(0.25)
    assert parse_latency("0.1s") == pytest.approx(100.0)
    assert parse_latency("0ms") == 0.0
    assert parse_flops("312tflops") == 312e12
    assert parse_flops("1.5GFLOPS") == 1.5e9
    assert parse_flops("100flops") == 100.0
    assert parse_memory("80GiB") == 80 * GiB
    assert parse_memory("16GB") == 16 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1TiB") == 2**40
    assert parse_memory("4096B") == 4096
    assert parse_memory("2KB") == 2000
    for fn, bad in [
        (parse_latency, "-1ms"),
        (parse_latency, "5"),
        (parse_latency, "5min"),
        (parse_flops, "0tflops"),
        (parse_flops, "312tops"),
        (parse_memory, "80G"),
        (parse_memory, "0.5B"),
        (parse_memory, "-1GiB"),
    ]:
        with pytest.raises(ConfigError, match="^k: "):
            fn(bad, "k")


# --- optional keys and presets ---------------------------------------------------------


def test_presets_fill_flops_and_memory() -> None:
    text = _site("A", device='"a100"') + _site("B", device='"H100"') + _link("A", "B")
    c = parse_cluster(text)
    d = c.devices()
    assert (d[0].flops, d[0].memory) == (312e12, 80 * GiB)
    assert (d[1].flops, d[1].memory) == (989e12, 80 * GiB)
    assert DEVICE_PRESETS["v100"] == (125e12, 32 * GiB)
    assert DEVICE_PRESETS["rtx3090"] == (71e12, 24 * GiB)


def test_explicit_device_keys_override_preset() -> None:
    text = _site("A", device='"rtx3090"', device_memory='"48GiB"')
    s = parse_cluster(text).sites["A"]
    assert s.device_flops == 71e12 and s.device_memory == 48 * GiB
    s = parse_cluster(_site("A", device_flops='"10tflops"')).sites["A"]
    assert s.device_flops == 10e12 and s.device_memory is None


def test_latency_recorded_on_sites_and_links() -> None:
    text = _site("A", latency='"0.2ms"') + _site("B") + _link("A", "B", latency='"30ms"')
    c = parse_cluster(text)
    assert c.sites["A"].latency_ms == pytest.approx(0.2)
    assert c.sites["B"].latency_ms == 0.0
    assert c.links[frozenset("AB")].latency_ms == 30.0
    assert c.to_dict()["links"][0]["latency_ms"] == 30.0


# --- every error, with its key path ----------------------------------------------------


def test_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: cluster file not found"):
        load_cluster(missing)


def test_not_toml() -> None:
    message = _fails("[sites.A\ndevices = 1", "test.toml: not valid TOML: ")
    assert "line 1" in message  # the parser's own message is kept


def test_no_sites() -> None:
    _fails('name = "x"\n', "sites: missing")
    _fails("[sites]\n", "sites: empty")
    _fails("sites = 3\n", "sites: must be tables")


def test_site_not_a_table() -> None:
    _fails("[sites]\nB = 3\n", "sites.B: site B must be a table")


def test_unknown_keys() -> None:
    _fails(
        'nme = "x"\n' + _site("A"), "top level: unknown key 'nme'", "known keys: name, sites, links"
    )
    _fails(
        _site("A", speed="2"),
        "sites.A: unknown key 'speed'",
        "known keys: devices, cpus, bandwidth",
    )
    _fails(
        _site("A") + _site("B") + _link("A", "B", rate='"1mbit"'),
        "links[0]: unknown key 'rate'",
        "known keys: sites, bandwidth, latency",
    )


@pytest.mark.parametrize("key", ["devices", "cpus", "bandwidth"])
def test_site_missing_required_key(key: str) -> None:
    _fails(
        _site("A") + _site("B", **{key: None}) + _link("A", "B"),
        f"sites.B.{key}: missing for site B",
    )


def test_link_missing_required_key() -> None:
    _fails(_site("A") + _site("B") + _link("A", "B", sites=None), "links[0].sites: missing")
    _fails(
        _site("A") + _site("B") + _link("A", "B", bandwidth=None),
        "links[0].bandwidth: missing",
        "between sites A and B",
    )


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ("0", "must be a whole number >= 1"),
        ("-2", "must be a whole number >= 1"),
        ("true", "got True"),
        ("1.5", "got 1.5"),
        ('"2"', "got '2'"),
    ],
)
def test_devices_type(value: str, expect: str) -> None:
    _fails(_site("B", devices=value), "sites.B.devices: ", expect, "site B")


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ("-1", "must be > 0, got -1"),
        ("0", "must be > 0"),
        ("0.0", "must be > 0"),
        ("65", "<= 64"),
        ("true", "a number of cores"),
        ('"0.5"', "a number of cores"),
        ("nan", "a number of cores"),
    ],
)
def test_cpus_type(value: str, expect: str) -> None:
    _fails(_site("B", cpus=value), "sites.B.cpus: ", expect)


def test_cpus_bounds_accepted() -> None:
    assert parse_cluster(_site("A", cpus="64")).sites["A"].cpus == 64
    assert parse_cluster(_site("A", cpus="0.01")).total_cpus == pytest.approx(0.01)


def test_bad_units_name_the_key() -> None:
    _fails(_site("B", bandwidth='"1gbps"'), "sites.B.bandwidth: ")
    _fails(_site("B", bandwidth="1000000000"), "sites.B.bandwidth: ", "quoted string")
    _fails(
        _site("A") + _site("B") + _link("A", "B", bandwidth='"fast"'),
        "links[0].bandwidth (sites A, B): ",
    )
    _fails(_site("B", latency='"5 minutes"'), "sites.B.latency: ")
    _fails(_site("B", latency='"-1ms"'), "sites.B.latency: must be >= 0")
    _fails(
        _site("A") + _site("B") + _link("A", "B", latency="5"), "links[0].latency (sites A, B): "
    )
    _fails(_site("B", device_flops='"312tops"'), "sites.B.device_flops: ")
    _fails(_site("B", device_memory='"80 gigs"'), "sites.B.device_memory: ")
    _fails(_site("B", device='"tpu"'), "sites.B.device: unknown preset 'tpu'", "a100")


def test_link_unknown_site() -> None:
    _fails(
        _site("A") + _site("B") + _link("A", "D"),
        "links[0].sites: unknown site 'D'",
        "sites are A, B",
    )


def test_link_same_site_twice() -> None:
    _fails(
        _site("A") + _link("A", "A"),
        "links[0].sites: a link joins two different sites",
        "sites.A.bandwidth",
    )


@pytest.mark.parametrize("sites", ['["A"]', '["A", "B", "C"]', '"A-B"', "[1, 2]"])
def test_link_not_two_sites(sites: str) -> None:
    text = _site("A") + _site("B") + _site("C") + _link("A", "B", sites=sites)
    _fails(text, "links[0].sites: must list exactly two site names")


def test_link_not_a_table() -> None:
    _fails("links = [1]\n" + _site("A"), "links[0]: must be a table")
    _fails("links = 1\n" + _site("A"), "links: must be tables")


def test_duplicate_link() -> None:
    text = _site("A") + _site("B") + _link("A", "B") + _link("B", "A")
    _fails(text, "links[1].sites: duplicate link between sites B and A", "first at links[0]")


def test_missing_link_names_both_sites() -> None:
    text = _site("A") + _site("B") + _site("C") + _link("A", "B") + _link("A", "C")
    _fails(text, "links: no [[links]] entry between sites B and C")


def test_too_many_devices() -> None:
    assert parse_cluster(_site("A", devices="1000")).num_devices == 1000  # simulated clusters may be big
    _fails(
        _site("A", devices="60000") + _site("B", devices="40001") + _link("A", "B"),
        "sites: 100001 devices in total, at most 100000",
    )


def test_testbed_refuses_more_than_a_subnet_of_workers() -> None:
    from fusionllm.testbed.sh import TestbedError
    from fusionllm.testbed.testbed import Testbed

    with pytest.raises(TestbedError, match="at most 230 workers"):
        Testbed(parse_cluster(_site("A", devices="231")))


def test_bad_site_name_and_name() -> None:
    _fails(
        '[sites."my site"]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n',
        "sites.'my site': a site name",
    )
    _fails("name = 3\n" + _site("A"), "name: must be a non-empty string")


def test_every_error_is_one_line_and_names_source(tmp_path: Path) -> None:
    path = tmp_path / "three-sites.toml"
    path.write_text(_site("A") + _site("B", cpus="-1") + _link("A", "B"))
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value) == f"{path}: sites.B.cpus: must be > 0, got -1"
