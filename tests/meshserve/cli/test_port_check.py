"""``meshserve up`` checks its ports before it starts anything: a port a listener holds
is taken; one whose last connections are only in TIME-WAIT (a mesh just stopped) is
free, as it is for gRPC's servers, which bind with SO_REUSEADDR."""

import socket

from meshserve.cli.ports import port_is_free


def test_a_listening_port_is_taken():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert port_is_free(server.getsockname()[1]) is False


def test_a_port_left_in_time_wait_is_free():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's servers bind
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()    # the server side closes first: its end of the connection enters TIME-WAIT
    server.close()
    client.close()
    assert port_is_free(port) is True
