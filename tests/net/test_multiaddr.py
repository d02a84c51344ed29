import ipaddress
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.net.identity import Identity, PeerID
from swarmgrad.net.multiaddr import Multiaddr
from swarmgrad.utils.errors import ValidationError

A = Identity.from_seed(bytes(range(32))).peer_id
B = Identity.from_seed(bytes(range(1, 33))).peer_id

peer_ids = st.binary(min_size=32, max_size=32).map(PeerID.from_public_key)
ports = st.integers(1, 65535)
ip4_hosts = st.ip_addresses(v=4).map(str)
ip6_hosts = st.ip_addresses(v=6).map(str)
dns_labels = st.from_regex(r"[a-z0-9]([a-z0-9_-]{0,20}[a-z0-9])?", fullmatch=True)
dns_hosts = st.lists(dns_labels, min_size=1, max_size=4).map(".".join)
direct_hosts = st.one_of(
    st.tuples(st.just("ip4"), ip4_hosts),
    st.tuples(st.just("ip6"), ip6_hosts),
    st.tuples(st.sampled_from(["dns", "dns4", "dns6"]), dns_hosts),
)


@st.composite
def multiaddr_strings(draw):
    protocol, host = draw(direct_hosts)
    text = f"/{protocol}/{host}/tcp/{draw(ports)}"
    if draw(st.booleans()):
        text += f"/p2p/{draw(peer_ids)}"
        if draw(st.booleans()):
            text += "/p2p-circuit"
            if draw(st.booleans()):
                text += f"/p2p/{draw(peer_ids)}"
    return text


@given(multiaddr_strings())
def test_canonical_strings_round_trip(text):
    addr = Multiaddr(text)
    assert str(addr) == text
    assert Multiaddr(str(addr)) == addr
    assert hash(Multiaddr(text)) == hash(addr)
    assert Multiaddr.parse(addr) is addr
    assert pickle.loads(pickle.dumps(addr)) == addr


@given(multiaddr_strings(), peer_ids)
def test_with_and_without_peer_id(text, peer_id):
    addr = Multiaddr(text)
    with_id = addr.with_peer_id(peer_id)
    assert with_id.peer_id == peer_id
    assert str(with_id).endswith(f"/p2p/{peer_id}")
    assert with_id.relay == addr.relay
    bare = with_id.without_peer_id()
    assert bare.peer_id is None
    assert (bare.host, bare.port, bare.relay) == (addr.host, addr.port, addr.relay)
    assert Multiaddr(str(bare)) == bare
    assert addr.with_peer_id(str(peer_id)) == with_id


def _looks_numeric(host):
    return all(c.isdigit() or c == "." for c in host)


@given(st.one_of(ip4_hosts, ip6_hosts, dns_hosts.filter(lambda h: not _looks_numeric(h))), ports)
def test_host_port_form_matches_the_multiaddr_form(host, port):
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    addr = Multiaddr(text)
    assert (addr.host, addr.port, addr.peer_id) == (host, port, None)
    assert addr.host_port == text
    assert Multiaddr(str(addr)) == addr
    assert Multiaddr.from_host_port(host, port) == addr


@given(st.ip_addresses(v=6))
def test_ipv6_is_canonicalized(ip):
    exploded = Multiaddr(f"/ip6/{ip.exploded}/tcp/1")
    assert exploded.host == str(ip)
    assert exploded == Multiaddr(f"/ip6/{ip}/tcp/1")


@given(st.text(max_size=120))
def test_arbitrary_text_parses_or_raises_validation_error(text):
    try:
        addr = Multiaddr(text)
    except ValidationError:
        return
    assert Multiaddr(str(addr)) == addr


def test_attributes_of_a_direct_address():
    addr = Multiaddr(f"/ip4/1.2.3.4/tcp/31337/p2p/{A}")
    assert addr.protocol == "ip4"
    assert addr.host == "1.2.3.4"
    assert addr.port == 31337
    assert addr.peer_id == A
    assert addr.relay is None
    assert not addr.is_relayed
    assert repr(addr) == f"Multiaddr('/ip4/1.2.3.4/tcp/31337/p2p/{A}')"


def test_attributes_of_a_relayed_address():
    relay = f"/dns4/relay.example.org/tcp/4001/p2p/{A}"
    addr = Multiaddr(f"{relay}/p2p-circuit/p2p/{B}")
    assert addr.is_relayed
    assert addr.relay == Multiaddr(relay)
    assert addr.relay.peer_id == A
    assert addr.peer_id == B
    assert (addr.host, addr.port) == ("relay.example.org", 4001)  # where to dial
    assert str(addr) == f"{relay}/p2p-circuit/p2p/{B}"
    assert str(addr.without_peer_id()) == f"{relay}/p2p-circuit"


def test_ipfs_is_read_as_p2p_and_dns_names_are_lowercased():
    assert str(Multiaddr(f"/dns/Example.ORG/tcp/1/ipfs/{A}")) == f"/dns/example.org/tcp/1/p2p/{A}"


def test_addresses_are_immutable():
    addr = Multiaddr("/ip4/1.2.3.4/tcp/1")
    with pytest.raises(AttributeError):
        addr.port = 2


def test_port_zero_only_when_asked():
    with pytest.raises(ValidationError, match="port 0"):
        Multiaddr("/ip4/0.0.0.0/tcp/0")
    with pytest.raises(ValidationError, match="port 0"):
        Multiaddr("0.0.0.0:0")
    with pytest.raises(ValidationError, match="port 0"):
        Multiaddr.from_host_port("::", 0)
    listen = Multiaddr("/ip4/0.0.0.0/tcp/0", allow_port_zero=True)
    assert listen.port == 0
    with pytest.raises(ValidationError, match="port 0"):
        Multiaddr.parse(listen)
    assert Multiaddr.parse(listen, allow_port_zero=True) is listen
    assert Multiaddr.from_host_port("::", 0, allow_port_zero=True).port == 0
    assert pickle.loads(pickle.dumps(listen)) == listen


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("/ip4/300.1.1.1/tcp/80", "300.1.1.1"),
        ("/ip4/1.2.3/tcp/80", "1.2.3"),
        ("/ip6/1.2.3.4/tcp/80", "1.2.3.4"),
        ("/ip6/fe80::1%eth0/tcp/80", "zone"),
        ("/dns/bad..name/tcp/80", "bad..name"),
        ("/dns/-bad/tcp/80", "-bad"),
        ("/ip4/1.2.3.4/tcp/65536", "65536"),
        ("/ip4/1.2.3.4/tcp/-1", "-1"),
        ("/ip4/1.2.3.4/tcp/http", "http"),
        ("/ip4/1.2.3.4/tcp/٣", "٣"),
        ("/udp/1.2.3.4/tcp/80", "udp"),
        ("/ip4/1.2.3.4/udp/80", "udp"),
        ("/ip4/1.2.3.4/tcp/80/quic", "/quic"),
        ("/ip4", "/ip4' needs a value"),
        ("/ip4/1.2.3.4", "missing /tcp"),
        ("/ip4/1.2.3.4/tcp", "/tcp' needs a value"),
        ("/ip4/1.2.3.4/tcp/", "/tcp' needs a value"),
        ("/ip4/1.2.3.4/tcp/80/p2p", "/p2p' needs a value"),
        ("/ip4/1.2.3.4/tcp/80/p2p/notapeerid", "notapeerid"),
        ("/ip4/1.2.3.4/tcp/80/", "unexpected '/'"),
        ("/ip4/1.2.3.4/tcp/80/p2p-circuit", "must follow the relay"),
        (f"/ip4/1.2.3.4/tcp/80/p2p/{A}/p2p-circuit/p2p/{B}/x", "/x"),
        (f"/ip4/1.2.3.4/tcp/80/p2p/{A}/p2p-circuit/tcp/1", "/tcp/1"),
        ("//ip4/1.2.3.4/tcp/80", "empty component"),
        ("/", "empty component"),
        ("", "host:port"),
        ("1.2.3.4", "host:port"),
        ("::1:80", "brackets"),
        ("[::1]80", "[IPv6]:port"),
        ("[1.2.3.4]:80", "1.2.3.4"),
        ("256.0.0.1:80", "256.0.0.1"),
        ("host:99999", "99999"),
        ("/ip4/" + "1" * 2000, "longer than"),
    ],
)
def test_invalid_addresses_name_the_offending_part(text, offending):
    with pytest.raises(ValidationError) as info:
        Multiaddr(text)
    assert offending in str(info.value)


def test_non_string_input_is_a_validation_error():
    with pytest.raises(ValidationError):
        Multiaddr(1234)
    with pytest.raises(ValidationError):
        Multiaddr.from_host_port("1.2.3.4", "80x")
    with pytest.raises(ValidationError):
        Multiaddr("/ip4/1.2.3.4/tcp/1").with_peer_id(42)


def test_numeric_hosts_are_read_as_ipv4_not_dns():
    with pytest.raises(ValidationError, match="IPv4"):
        Multiaddr("1.2.3:80")
    assert Multiaddr("10.0.0.1:80").protocol == "ip4"
    assert Multiaddr("/dns/123/tcp/80").host == "123"  # explicit /dns is taken at its word


def test_ipv4_in_ipv6_and_unspecified_addresses():
    assert Multiaddr("/ip6/::ffff:1.2.3.4/tcp/1").host == str(
        ipaddress.IPv6Address("::ffff:1.2.3.4")
    )
    assert Multiaddr("[::]:8080").host_port == "[::]:8080"
