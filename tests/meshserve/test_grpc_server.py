"""Keepalive settings of clients and servers agree, so long-lived streams (an
executor's Connect, a slow token stream) are never cut with GOAWAY too_many_pings."""

from meshserve.grpc_server import CHANNEL_OPTIONS, SERVER_OPTIONS


def test_server_accepts_the_clients_ping_rate():
    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1
