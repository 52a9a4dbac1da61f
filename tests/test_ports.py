import socket

from ckptdoctor.ports import free_port


def test_a_free_port_can_be_bound_and_listened_on_at_once():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert sock.getsockname()[1] == port
